"""`ray-reshard simulate`: predict a refit's time on a described cluster.

    ray-reshard simulate --model deepseek-v3 --train megatron:pp=16,ep=16 \\
        --infer vllm:tp=32,dp=8 --cluster dgx-h100 [--json]

The model is a recipe name or a Hugging Face config.json path; layouts are
`megatron:tp=..,pp=..,ep=..,etp=..,dp=..,cp=..` and `vllm:tp=..,dp=..,pp=..,ep=..`. Without dp,
Megatron gets the smallest data-parallel size that makes each stage a multiple of ep*etp.
Ranks fill NVLink domains in order (`--gpus-per-domain` of the cluster) on each side; training
and inference use different GPUs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional

from .cli_args import (DTYPES, MODELS, add_hf_experts_arg, describe, dtype_arg,
                        even_out_stages, fraction_arg, infer_arg, model_arg, quantized, say,
                        train_arg, with_hf_experts)
from ..planning.plan import DEFAULT_BUCKET_BYTES
from ..sim.bound import check_plan, layout_bound
from ..sim.cluster import GB, NOT_MODELLED, PRESETS, constants, preset, uncertain
from ..sim.delta import ASSUMPTIONS as DELTA_ASSUMPTIONS
from ..sim.delta import DELTA_CONSTANTS, simulate_delta
from ..sim.engine import (RING_RECV, gather_broadcast_seconds, messages_aggregate, messages_exact,
                     replay, simulate)

EXACT_MAX_MOVES = 200_000       # --mode auto: the exact replay up to this many moves


class _Exit(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):           # one line, exit 2, no usage dump
        raise _Exit(message)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="ray-reshard simulate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=model_arg,
                    help=f"a known model ({', '.join(MODELS)}) or a path to a HF config.json")
    ap.add_argument("--train", required=True, type=train_arg,
                    help="training layout, e.g. megatron:pp=16,ep=16")
    ap.add_argument("--infer", required=True, type=infer_arg,
                    help="inference layout, e.g. vllm:tp=32,dp=8")
    add_hf_experts_arg(ap)
    ap.add_argument("--cluster", default="dgx-h100", help=f"preset: {', '.join(PRESETS)}")
    ap.add_argument("--dtype", type=dtype_arg, default="bfloat16",
                    help=f"inference dtype: {', '.join(DTYPES)} (fp8: block FP8, 128 x 128 "
                         f"scales; default bf16)")
    ap.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / (1 << 20),
                    help=f"bucket size (default {DEFAULT_BUCKET_BYTES >> 20}, the library's)")
    ap.add_argument("--mode", default="auto", choices=("auto", "exact", "aggregate"),
                    help="exact: replay the schedule's buckets; aggregate: per-pair bytes per "
                         "round (fast at any scale); auto: exact for small plans")
    ap.add_argument("--window", type=int, default=None,
                    help="staged buckets in flight per process (default: the executor's, as "
                         "many as fit in 128 MiB, 2 to 16)")
    ap.add_argument("--ring-recv", default="runs", choices=RING_RECV,
                    help="runs: as the executor does, each run of ring (domain) steps takes "
                         "whichever bucket is ready first; in_order: strictly in the "
                         "schedule's order; as_ready: what-if, taken whenever they arrive")
    ap.add_argument("--gpus-per-domain", "--gpus-per-node", dest="gpus_per_domain", type=int,
                    help="ranks per NVLink domain (default: the cluster's)")
    ap.add_argument("--nvlink-gbps", type=float, help="NVLink GB/s per GPU per direction")
    ap.add_argument("--nic-gbit", type=float, help="NIC Gb/s per GPU per direction")
    ap.add_argument("--latency-us", type=float, help="per-message latency")
    ap.add_argument("--item-us", type=float, help="executor CPU time per item")
    ap.add_argument("--tensor-us", type=float, help="CPU time per local tensor per process")
    ap.add_argument("--shard-us", type=float, help="CPU time per shard per process")
    ap.add_argument("--step-us", type=float, help="CPU time per bucket end besides its items")
    ap.add_argument("--copy-tables", choices=("on", "off"), default=None,
                    help="a bucket end's regions copied by one launch (on: no cost per item; "
                         "default: the cluster's)")
    ap.add_argument("--host-overlap", choices=("on", "off"), default=None,
                    help="the host issues copies while the GPU runs earlier ones (on: steps on the "
                         "host's clock, copies on the stream's; default: the cluster's)")
    ap.add_argument("--ring-carry", choices=("on", "off"), default=None,
                    help="a run of ring steps leaves receives not there yet behind, taken once "
                         "ready (on: NCCL's executor; default: the cluster's)")
    ap.add_argument("--ring-slots", type=int, default=None,
                    help="slots per ring (default 2, the executor's; 0: no limit, a what-if)")
    ap.add_argument("--timeline", default=None, help="rank whose timeline to show, e.g. dst:0 "
                                                     "(default: the one with the busiest link)")
    ap.add_argument("--changed-fraction", type=fraction_arg, metavar="F",
                    help="also predict a delta refit with this fraction of the elements changed "
                         "since the previous one (e.g. 0.1)")
    ap.add_argument("--delta-encode-gbps", type=float,
                    help="a delta refit's sender: bucket GB compared and encoded per second")
    ap.add_argument("--delta-decode-gbps", type=float,
                    help="a delta refit's receiver: bucket GB decoded and checked per second")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--sensitivity", choices=("on", "off"), default=None,
                    help="also predict with each uncertain constant halved and doubled "
                         "(default: on with --json, off otherwise)")
    return ap


def _on(flag: Optional[str]) -> Optional[bool]:
    """An on/off flag's value; None (not given) keeps the cluster's."""
    return None if flag is None else flag == "on"


def run(args, variants: Optional[dict] = None) -> dict:
    """Simulate as the parsed `args` say. `variants` {name: Cluster field changes}: also the
    reshard prediction on the same plan with the cluster changed so, in `out["variants"]`."""
    from ..planning.plan import plan as make_plan
    from .cli_args import recipe_specs

    cl = preset(args.cluster).with_(
        gpus_per_domain=args.gpus_per_domain,
        nvlink_Bps=None if args.nvlink_gbps is None else args.nvlink_gbps * GB,
        nic_Bps=None if args.nic_gbit is None else args.nic_gbit / 8 * GB,
        latency_s=None if args.latency_us is None else args.latency_us * 1e-6,
        item_s=None if args.item_us is None else args.item_us * 1e-6,
        tensor_s=None if args.tensor_us is None else args.tensor_us * 1e-6,
        shard_s=None if args.shard_us is None else args.shard_us * 1e-6,
        step_s=None if args.step_us is None else args.step_us * 1e-6,
        copy_tables=_on(args.copy_tables), host_overlap=_on(args.host_overlap),
        ring_carry=_on(args.ring_carry), ring_slots=args.ring_slots,
        delta_encode_Bps=None if args.delta_encode_gbps is None else args.delta_encode_gbps * GB,
        delta_decode_Bps=None if args.delta_decode_gbps is None else args.delta_decode_gbps * GB)
    if args.window is not None and not 1 <= args.window <= 16:
        raise ValueError(f"--window must be in 1..16, got {args.window}")
    if args.bucket_mb <= 0:
        raise ValueError(f"--bucket-mb must be positive, got {args.bucket_mb}")
    bucket = int(args.bucket_mb * (1 << 20))
    timeline = None
    if args.timeline:
        side, _, r = args.timeline.partition(":")
        if side not in ("src", "dst") or not r.isdigit():
            raise ValueError(f"--timeline must look like src:3 or dst:0, got {args.timeline!r}")
        timeline = (side, int(r))
    title, config = args.model
    train = even_out_stages(args.train, config.get("num_hidden_layers", 0))
    train = with_hf_experts(train, args.hf_experts)
    infer, dtype = quantized(args.infer, args.dtype)
    if timeline and timeline[1] >= (train.world if timeline[0] == "src" else infer.world):
        raise ValueError(f"--timeline: {args.timeline} is beyond that side's ranks")
    given = tuple(n for n, v in (
        ("gpus_per_domain", args.gpus_per_domain), ("nvlink_Bps", args.nvlink_gbps),
        ("nic_Bps", args.nic_gbit), ("latency_s", args.latency_us), ("item_s", args.item_us),
        ("tensor_s", args.tensor_us), ("shard_s", args.shard_us), ("step_s", args.step_us),
        ("delta_encode_Bps", args.delta_encode_gbps), ("delta_decode_Bps", args.delta_decode_gbps))
        if v is not None)
    t0 = time.perf_counter()
    specs = recipe_specs(config, train, infer, dtype, args.hf_experts)
    g = cl.gpus_per_domain
    p = make_plan(specs, [("train", r // g) for r in range(train.world)],
                  [("infer", r // g) for r in range(infer.world)])
    mode = args.mode
    if mode == "auto":
        mode = "exact" if p.stats.n_moves <= EXACT_MAX_MOVES else "aggregate"
    msgs = (messages_exact if mode == "exact" else messages_aggregate)(
        p, bucket, cl.per_item_min_bytes)
    again = lambda c: replay(p, msgs, c, bucket, None, args.window, args.ring_recv).predicted_s
    res = replay(p, msgs, cl, bucket, timeline, args.window, args.ring_recv)
    predicted = {name: again(cl.with_(**changes)) for name, changes in (variants or {}).items()}
    consts = constants(cl, args.cluster, given)
    sensitivity = None
    if (args.sensitivity or ("on" if args.json else "off")) == "on":
        sensitivity = []
        for name in uncertain(consts, gpu=args.cluster != "local"):
            v = getattr(cl, name)
            low, high = again(cl.with_(**{name: v / 2})), again(cl.with_(**{name: v * 2}))
            sensitivity.append({"name": name, "half_s": low, "double_s": high})
        # datasheet NIC rates: what NCCL reaches of them is not modelled, so vary it
        nic_efficiency = {str(e): again(cl.with_(nic_Bps=cl.nic_Bps * e))
                          for e in NIC_EFFICIENCY}
    lb = layout_bound(specs.values(), train.world, infer.world, g, cl.nic_Bps)
    short = check_plan(lb, p.recv_bytes_by_rank)
    gb = gather_broadcast_seconds(p, cl, bucket)
    # direct point-to-point: every rank its own domain, so no de-duplication inside domains
    direct_plan = make_plan(specs, n_src=train.world, n_dst=infer.world)
    direct = simulate(direct_plan, cl.with_(gpus_per_domain=1), bucket, args.mode,
                      window=args.window, ring_recv=args.ring_recv)
    out = res.as_dict()
    out.update(model=title, train=str(train), infer=str(infer), tensors=len(specs),
               total_bytes=p.stats.total_bytes, gather_broadcast_s=gb,
               gather_broadcast_bytes=p.stats.gather_broadcast_bytes,
               direct_s=direct.predicted_s, ring_recv=args.ring_recv,
               direct_network_bytes=direct.network_bytes,
               cluster_description=cl.describe(), constants=consts,
               not_modelled=list(NOT_MODELLED), layout_bound=lb.as_dict(),
               plan_within_layout_bound=short is None, plan_check=short or "ok")
    if sensitivity is not None:
        out["sensitivity"] = sensitivity
        out["nic_efficiency_s"] = nic_efficiency
        lows = [x for s in sensitivity for x in (s["half_s"], s["double_s"])] + [res.predicted_s]
        lows += list(nic_efficiency.values())
        out["sensitivity_range_s"] = [min(lows), max(lows)]
    if variants:
        out["variants"] = predicted
    if args.changed_fraction is not None:
        out["delta"] = _delta(p, msgs, cl, bucket, args, given, sensitivity is not None,
                              res.predicted_s)
    out["wall_s"] = time.perf_counter() - t0
    return out


# the share of a NIC's datasheet rate a collective library reaches, low and high
NIC_EFFICIENCY = (0.7, 0.95)


def _delta(p, msgs, cl, bucket, args, given, sensitivity: bool, dense_s: float) -> dict:
    """The delta refit's prediction (`sim.delta`), beside the dense one."""
    d = simulate_delta(p, msgs, cl, bucket, args.changed_fraction, args.window, args.ring_recv)
    d.update(dense_predicted_s=dense_s, over_dense_s=d["predicted_s"] / dense_s,
             over_dense_bytes=(d["network_bytes"] / d["dense_network_bytes"]
                               if d["dense_network_bytes"] else None),
             constants=constants(cl, args.cluster, given, delta=True),
             assumptions=list(DELTA_ASSUMPTIONS))
    if sensitivity:
        d["sensitivity"] = []
        for name in DELTA_CONSTANTS:
            v = getattr(cl, name)
            again = lambda c: simulate_delta(p, msgs, c, bucket, args.changed_fraction,
                                             args.window, args.ring_recv)["predicted_s"]
            d["sensitivity"].append({"name": name, "half_s": again(cl.with_(**{name: v / 2})),
                                     "double_s": again(cl.with_(**{name: v * 2}))})
    return d


def render_delta(d: dict) -> str:
    """The delta prediction as text (labelled a prediction, with its assumptions)."""
    gbs = lambda b: f"{b / 1e9:,.3f} GB"
    lines = [
        f"delta refit, PREDICTED for {d['changed_fraction']:g} of the elements changed since "
        f"the previous delta refit:",
        f"  delta              predicted {d['predicted_s']:8.3f} s  (dense "
        f"{d['dense_predicted_s']:.3f} s: {d['over_dense_s']:.2f}x)",
        f"  network {gbs(d['network_bytes'])} vs dense {gbs(d['dense_network_bytes'])}"
        + (f" ({d['over_dense_bytes']:.3f}x)" if d["over_dense_bytes"] is not None else "")
        + "; network buckets " + ", ".join(f"{k} {n}" for k, n in d["encodings"].items()),
        "  constants (value, provenance, source):",
    ]
    for c in d["constants"]:
        lines.append(f"    {c['name']:<18} {c['value']:>12.4g}  {c['provenance']:<21} "
                     f"{c['source']}")
    if d.get("sensitivity"):
        lo = min(min(s["half_s"], s["double_s"]) for s in d["sensitivity"])
        hi = max(max(s["half_s"], s["double_s"]) for s in d["sensitivity"])
        lines.append(f"  sensitivity: predicted {min(lo, d['predicted_s']):.3f}-"
                     f"{max(hi, d['predicted_s']):.3f} s with each codec constant halved or "
                     f"doubled (one at a time):")
    for s in d.get("sensitivity", ()):
        lines.append(f"    {s['name']:<18} x0.5 {s['half_s']:.3f} s   x2 {s['double_s']:.3f} s")
    lines.append("  assumptions: " + "; ".join(d["assumptions"]))
    return "\n".join(lines)


def render(o: dict) -> str:
    gbs = lambda b: f"{b / 1e9:,.1f} GB"
    lines = [
        f"{o['model']}: {o['train']} -> {o['infer']}, {o['tensors']} tensors, "
        f"{gbs(o['total_bytes'])}",
        f"cluster {o['cluster_description']}",
        f"network {gbs(o['network_bytes'])} (lower bound {gbs(o['min_network_bytes'])}), "
        f"NVLink {gbs(o['domain_bytes'])}; {o['messages']} buckets in {o['rounds']} rounds "
        f"of {o['bucket_bytes'] / 2**20:.0f} MiB, window {o['window']}"
        + (" (aggregate: per-pair byte counts per round, not the schedule's own buckets)"
           if o["mode"] == "aggregate" else " (the schedule's buckets)"),
        "",
        "every time below is a prediction of this simulator under the constants listed at the "
        "end, not a measurement",
        f"reshard            predicted {o['predicted_s']:8.3f} s"
        + {"as_ready": "  (what-if: ring receives taken as they arrive)",
           "in_order": "  (ring steps strictly in key order)"}.get(o["ring_recv"], ""),
        f"  bound            {o['bound_s']:8.3f} s  (busiest NIC {o['nic_bound_s']:.3f} s, "
        f"busiest NVLink {o['nvlink_bound_s']:.3f} s); predicted / bound = "
        f"{o['predicted_s'] / o['bound_s'] if o['bound_s'] else float('nan'):.2f}",
        f"  balanced bound   {o['balanced_bound_s']:8.3f} s  (the lower bound's bytes spread "
        f"evenly over every destination NIC)",
        f"  layout bound     {o['layout_bound']['bound_s']:8.3f} s  (from the layouts alone, "
        f"not the plan: each domain's distinct needed bytes over its own NICs); predicted / "
        f"layout bound = {o['predicted_s'] / o['layout_bound']['bound_s'] if o['layout_bound']['bound_s'] else float('nan'):.2f}; "
        f"plan's network bytes per destination domain >= the layouts' need: "
        f"{'yes' if o['plan_within_layout_bound'] else 'NO: ' + o['plan_check']}",
        f"direct p2p         predicted {o['direct_s']:8.3f} s  (no domain de-duplication, "
        f"network {gbs(o['direct_network_bytes'])})",
        f"gather_broadcast   predicted {o['gather_broadcast_s']:8.3f} s  "
        f"({gbs(o['gather_broadcast_bytes'])} received)",
        "",
        "busiest links:",
    ]
    for link in o["busiest_links"]:
        lines.append(f"  {link['link']:<22} {gbs(link['bytes']):>12}  {link['seconds']:.3f} s at full rate")
    tl = o["timeline"]
    lines.append(f"timeline of {o['timeline_rank']} ({len(tl)} rounds with work"
                 + (", first 8 and last 2)" if len(tl) > 10 else ")") + ":")
    shown = tl if len(tl) <= 10 else tl[:8] + tl[-2:]
    for row in shown:
        lines.append(f"  round {row['round']:>4}  {row['start_s']:8.4f}-{row['end_s']:8.4f} s  "
                     f"NIC out {row['nic_send'] / 1e6:8.1f} MB in {row['nic_recv'] / 1e6:8.1f} MB  "
                     f"NVLink out {row['nvlink_send'] / 1e6:8.1f} MB in {row['nvlink_recv'] / 1e6:8.1f} MB"
                     f"  ({row['limited_by']})")
    lines.append("constants (value, provenance, source):")
    for c in o["constants"]:
        v = c["value"]
        lines.append(f"  {c['name']:<18} {v:>12.4g}  {c['provenance']:<21} {c['source']}")
    lines.append("not modelled: " + "; ".join(o["not_modelled"]))
    if "sensitivity" in o:
        lo, hi = o["sensitivity_range_s"]
        lines.append(f"sensitivity: predicted {lo:.3f}-{hi:.3f} s with each of these constants "
                     f"halved or doubled (one at a time), and with the NICs at part of their rate:")
        for s in o["sensitivity"]:
            lines.append(f"  {s['name']:<18} x0.5 {s['half_s']:.3f} s   x2 {s['double_s']:.3f} s")
        eff = o.get("nic_efficiency_s", {})
        if eff:
            lines.append("  NIC efficiency     " + "   ".join(
                f"{float(e):.2f} of nic_Bps {t:.3f} s" for e, t in eff.items()))
    else:
        lines.append("(--sensitivity on: the prediction with each uncertain constant halved and "
                     "doubled)")
    if "delta" in o:
        lines.append(render_delta(o["delta"]))
    lines.append(f"(simulated in {o['wall_s']:.1f} s)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
        preset(args.cluster)             # a wrong name ends in its one error line, no progress
        say(f"simulating {args.model[0]}: {describe(args.train)} -> {describe(args.infer)} on "
            f"{args.cluster} (specs, two plans and the replay: seconds to a minute)...")
        out = run(args)
    except (_Exit, ValueError, KeyError, FileNotFoundError, TypeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"ray-reshard simulate: error: {msg}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    else:
        print(render(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
