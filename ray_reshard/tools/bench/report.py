"""Run the benchmarks and write their figures to one generated page (no figure typed by hand).

    python -m ray_reshard.tools.bench.report [--small] [--sections a,b] [--out docs/benchmarks.md]
    python -m ray_reshard.tools.bench.report --check [--sections peers,first-refit,replay]

Each section runs one command as a user would; its raw output is kept (`--keep DIR`) and the
page is rendered from what is kept (`--from DIR`). `--check` compares a rerun with the page's
predictions. Details: docs/benchmark-commands.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from ...execution.program import PER_ITEM_MIN_BYTES
from .harness import machine_facts, predicted_range, settle

ROOT = str(Path(__file__).resolve().parents[3])
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
RESULTS = os.path.join(ROOT, "docs", "benchmark-results")   # the page's kept raw outputs
# a --check run's raw outputs where it writes its comparison as a page (docs/reproduction.md)
REPRODUCTION = os.path.join(ROOT, "docs", "reproduction-results")
PY = "python -m"

# name -> (title, full arguments, small arguments (None: not run with --small), writes JSON)
SECTIONS = {
    "peers": ("reshard and its peers on the same actors",
              ["ray_reshard", "bench-peers", "--mb", "256", "--repeats", "5", "--runs", "3"],
              ["ray_reshard", "bench-peers", "--mb", "16", "--counts", "32,64",
               "--repeats", "2", "--runs", "2"], True),
    "first-refit": ("The first refit at scale (CPU seconds)",
                    ["ray_reshard", "bench-first-refit"],
                    ["ray_reshard", "bench-first-refit", "--models", "qwen3-235b", "--wide",
                     "0"], True),
    "replay": ("The executor at model scale (CPU seconds)",
               ["ray_reshard", "bench-replay", "--model", "deepseek-v3", "--repeat", "5",
                "--runs", "3"],
               ["ray_reshard", "bench-replay", "--model", "qwen3-235b", "--repeat", "1", "--runs",
                "2"],
               True),
    "calibrate": ("The simulator against refits measured on this machine",
                  ["ray_reshard.tools.bench.sim_calibrate", "--mb", "64", "--repeats", "3"],
                  ["ray_reshard.tools.bench.sim_calibrate", "--mb", "4", "--repeats", "1", "--runs",
                   "1"], True),
    "simulate": ("One prediction in full: constants, provenance, sensitivity",
                 ["ray_reshard", "simulate", "--model", "deepseek-v3", "--train",
                  "megatron:pp=16,ep=16", "--infer", "vllm:tp=32,dp=8", "--cluster",
                  "dgx-h100"],
                 ["ray_reshard", "simulate", "--model", "small-moe", "--train",
                  "megatron:pp=2,ep=2,dp=2", "--infer", "vllm:tp=2,dp=2,ep=2",
                  "--gpus-per-domain", "2"], "stdout"),
    "delta": ("Delta refits vs dense refits at synthetic changed fractions",
              ["ray_reshard", "bench-delta", "--synthetic", "0,0.001,0.1,0.5,1.0", "--mb", "256",
               "--repeats", "5", "--runs", "3"],
              ["ray_reshard", "bench-delta", "--small", "--synthetic", "0,0.1,1.0", "--runs",
               "2"], True),
    "delta-trace": ("Delta refits vs dense refits along an RL-like training trace",
                    ["ray_reshard", "bench-delta", "--mb", "256", "--steps", "5", "--lr", "1e-6",
                     "--runs", "3"],
                    ["ray_reshard", "bench-delta", "--small", "--runs", "2"], True),
    "delta-simulate": ("A delta refit predicted on a real cluster",
                       ["ray_reshard", "simulate", "--model", "llama70b", "--train",
                        "megatron:tp=8,pp=4", "--infer", "vllm:tp=8,dp=4", "--cluster",
                        "dgx-h100", "--changed-fraction", "0.1", "--sensitivity", "on"],
                       ["ray_reshard", "simulate", "--model", "small-moe", "--train",
                        "megatron:pp=2,ep=2,dp=2", "--infer", "vllm:tp=2,dp=2,ep=2",
                        "--gpus-per-domain", "2", "--changed-fraction", "0.1"], False),
    "shaped-peers": ("reshard and its peers on shaped links (a cluster in a box)",
                     ["ray_reshard", "bench-peers", "--shaped", "1gbit,2gbit", "--mb", "128",
                      "--repeats", "5"],
                     ["ray_reshard", "bench-peers", "--shaped", "1gbit", "--mb", "8",
                      "--counts", "32", "--repeats", "1"], True),
    "shaped-calibrate": ("The simulator against refits on shaped links",
                         ["ray_reshard.tools.bench.sim_calibrate", "--check", "--rates",
                          "1gbit,2gbit", "--mb", "64", "--repeats", "5"],
                         ["ray_reshard.tools.bench.sim_calibrate", "--check", "--rates", "1gbit",
                          "--layouts", "0", "--mb", "4", "--count", "8", "--repeats", "1"],
                         True),
    "shaped-delta": ("Delta refits vs dense refits on shaped links",
                     ["ray_reshard", "bench-delta", "--shaped", "1gbit", "--synthetic",
                      "0,0.1,1.0", "--mb", "256", "--repeats", "5"], None, False),
    "shaped-delta-trace": ("Delta refits along an RL-like trace on shaped links",
                           ["ray_reshard", "bench-delta", "--shaped", "1gbit", "--mb", "256",
                            "--steps", "5", "--lr", "1e-6"], None, False),
    "published": ("Published refit figures beside predictions",
                  ["ray_reshard.tools.bench.sim_published"],
                  ["ray_reshard.tools.bench.sim_published", "--rows", "7"], False),
}
NOISE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(INFO|WARNING|ERROR)|\(raylet\)|"
                   r"\[\d{4}-\d\d-\d\d)")


def command_line(name: str, small: bool) -> str:
    _, full, little, _ = SECTIONS[name]
    return f"{PY} {' '.join(little if small and little is not None else full)}"


def _commit() -> str:
    """HEAD's short hash, with "+uncommitted" where the package's code differs from it (the
    figures then come from code no commit holds)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "ray_reshard"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head + ("+uncommitted" if dirty else "")


SECTION_SETTLE_S = 120.0     # the longest wait for a quiet machine before a section


def run_section(name: str, small: bool, keep: str) -> dict:
    """Run one section's command; returns {"stdout", "json", "seconds", "command"}."""
    _, full, little, wants_json = SECTIONS[name]
    args = list(little if small else full)
    path = os.path.join(keep, f"{name}.json")
    if wants_json is True:
        args += ["--json", path]
    elif wants_json == "stdout":
        args += ["--json"]
    # what the previous section left running (a cluster shutting down) ends first
    waited = settle(quiet=0.25, window_s=1.0, limit_s=SECTION_SETTLE_S)
    t0, commit, load0 = time.time(), _commit(), os.getloadavg()[0]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True)
    out = {"command": command_line(name, small), "seconds": time.time() - t0,
           "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)), "commit": commit,
           "returncode": p.returncode, "load": [round(load0, 2), round(os.getloadavg()[0], 2)],
           "settled_s": round(waited, 1),
           "stdout": "\n".join(line for line in p.stdout.splitlines()
                               if not NOISE.match(line)).strip()}
    if p.returncode != 0:
        raise RuntimeError(f"{out['command']} exited {p.returncode}:\n{p.stdout[-2000:]}\n"
                           f"{p.stderr[-3000:]}")
    if wants_json is True:
        with open(path) as f:
            out["json"] = json.load(f)
        os.remove(path)                       # kept once, inside the .out.json below
    elif wants_json == "stdout":
        out["json"] = json.loads(out["stdout"].splitlines()[-1])
        out["stdout"] = ""
    with open(os.path.join(keep, f"{name}.out.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


# ------------------------------------------------------------------------------ rendering
def _table(head: list, rows: list) -> list:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return lines


PREDICTION = "95% prediction for a further run"


def _prediction(values) -> Optional[tuple]:
    """`harness.predicted_range` of the runs' figures, None for fewer than two."""
    return predicted_range(values) if values and len(values) > 1 else None


def _span_text(span: Optional[tuple], none: str = "") -> str:
    return none if span is None else f"{span[0]:.2f}-{span[1]:.2f}"


def _goal_rows(goals: list) -> list:
    """(goal, measured, met, prediction); with several runs the measured median's range over
    them, in how many runs the goal was met, and where a further run's figure would fall (see
    `harness.predicted_range`)."""
    rows = []
    for g in goals:
        measured, met = f"{g['measured']:.2f}", "met" if g["met"] else "**not met**"
        if g.get("runs", 1) > 1:
            measured += f" [{g['low']:.2f}-{g['high']:.2f}]"
            met += f" ({g['runs_met']} of {g['runs']} runs)"
        rows.append((g["goal"], measured, met, _span_text(_prediction(g.get("values")))))
    return rows


def render_peers(r: dict) -> list:
    from .peers import PEERS, extra_table, goals, peer_table

    o = r["json"]
    runs = o.get("runs", 1)
    if runs > 1:
        how = (f"each figure the median over {runs} runs, each on a fresh cluster, of that "
               f"run's median of {o['repeats']} after a warm-up; [range] is the lowest and "
               f"highest run median: how far a fresh cluster moved the figure (were the runs "
               f"alike, a further run's median would fall inside the range of {runs} runs' "
               f"medians with chance {(runs - 1) / (runs + 1):.0%}; the goals' last column "
               f"is a 95% prediction for a further run instead); the peers take turns "
               f"in an order rotated each repeat, each timed run starting once the machine is "
               f"quiet")
    else:
        how = (f"median [range] of {o['repeats']} after a warm-up, peers taking turns within "
               f"each repeat")
    lines = [f"{o['layout']}, {o['mb']} MiB per case; object store "
             f"{min(o['store_bytes_per_node'].values()) / 2**20:.0f} MiB per node, Ray's spill "
             f"counters read before and after every case (nothing spilled, or the run fails); "
             f"seconds from the driver's call to every destination holding the weights, {how}. "
             f"Ray Direct Transport: {o['rdt']}.", ""]
    head, rows = peer_table(o, PEERS, (
        ("object store", "x", "reshard vs object store"),
        ("raw share", "", "reshard's share of raw point-to-point")))
    lines += _table(head, rows)
    head, rows = extra_table(o)
    if rows:
        lines += ["", "In the same turns: Ray Direct Transport with one flat tensor per source; "
                      "the fair pair of raw point-to-point: reshard TP4 -> TP4 (the raw sends' "
                      "pairs and bytes) and the forward reshard adds (replica 0 into replica 1, "
                      "inside node 1); at 4096 tensors, reshard over the same bytes in 1024 "
                      "tensors (the rise's goal: the median of the rounds' differences).", ""]
        lines += _table(head, rows)
    lines += ["", "Goals (medians" + (" over the runs" if runs > 1 else "") + "):", ""]
    lines += _table(["goal", "measured", "", PREDICTION], _goal_rows(goals(o)))
    return lines


def render_first_refit(r: dict) -> list:
    o = r["json"]
    head = ["model", "ranks", "tensors", "specs", "lookup", "plan", "turns", "put",
            "driver", "shipped MB", "load", "install dst / src", "busiest process"]
    rows = []

    def spread(x, key):
        lo_hi = x.get(key + "_range")
        return f"**{x[key]:.2f}**" + (f" [{lo_hi[0]:.2f}-{lo_hi[1]:.2f}]" if lo_hi else "")

    for ranks, x in o["rows"].items():
        turns = f"{x['turns_s']:.2f}" if x["turns"] else f"- ({x['turns_s']:.2f})"
        rows.append((x["model"], ranks, f"{x['tensors']:.0f}", f"{x['specs_s']:.2f}",
                     f"{x['lookup_s']:.2f}", f"{x['plan_s']:.2f}", turns, f"{x['put_s']:.2f}",
                     spread(x, "driver_s"), f"{x['shipped_mb']:.1f}", f"{x['load_s']:.2f}",
                     f"{x['install_dst_s']:.2f} / {x['install_src_s']:.2f}",
                     spread(x, "busiest_s")))
    repeats = o.get("repeats", 1)
    lines = ["driver = specs + plan-cache lookup + plan + network turns (`-`: the plan keeps "
             "the rotation schedule) + pickling the plan and copying its bytes once (`put`); "
             "busiest process = unpickling the plan (`load`) + the runtime's own "
             "`worker.install` (localize, shard table, compile), each in a fresh process, the "
             "slower of the busiest destination and the busiest source."
             + (f" Each figure is the median of {repeats} measurements; [range] is the lowest "
                f"and highest of them; a goal is judged on the medians. The cases take turns "
                f"within each repeat, and one run's measurements follow each other within two "
                f"minutes: CPU seconds on this shared host move more between runs hours apart "
                f"than within one (`--check` shows by how much)."
                if repeats > 1 else ""),
             ""]
    lines += _table(head, rows)
    if o["goals"]:
        lines += ["", "Goals:", ""] + _table(["goal", "measured", "", PREDICTION],
                                             _goal_rows(o["goals"]))
    return lines


def render_calibrate(r: dict) -> list:
    o = r["json"]
    lines = [f"{o['runs']} calibration runs. Each measures the constants with primitive "
             f"transfers, then refits each case {o['repeats']} times after a warm-up (median "
             f"[range]) beside the simulator's prediction with that run's constants. A "
             f"prediction whose median over the runs is more than 25% off is a miss.", ""]
    rows = []
    for k, run in enumerate(o["per_run"]):
        for x in run["rows"]:
            rows.append((k + 1, x["case"], f"{x['mb']:.1f}", x["items"] or "",
                         f"{x['median_s']:.3f} [{x['low_s']:.3f}-{x['high_s']:.3f}]",
                         f"{x['predicted_s']:.3f}", f"{x['ratio']:.2f}"))
    lines += _table(["run", "case", "MB", "items", "measured s", "predicted s", "pred / meas"],
                    rows)
    lines += ["", "Constants measured by each run:", ""]
    lines += [f"{k + 1}. {run['cluster']}" for k, run in enumerate(o["per_run"])]
    lines += ["", "Over the runs:", ""]
    lines += _table(["case", "pred / meas: median [range]", "", PREDICTION],
                    [(x["case"], f"{x['ratio']:.2f} [{x['low']:.2f}-{x['high']:.2f}]",
                      "**miss**" if x["miss"] else "", _span_text(_prediction(x.get("ratios"))))
                     for x in o["summary"]])
    ours = [x for x in o["summary"] if x["strategy"] == "reshard"]
    lines += ["", f"{len(ours) - sum(x['miss'] for x in ours)} of {len(ours)} reshard "
                  f"predictions within 25% (median over the runs), worst off by "
                  f"{100 * o['worst']:.0f}%; {sum(x['ratio'] < 1 for x in ours)} of "
                  f"{len(ours)} predict less time than was measured (a bias, not noise, "
                  f"where that is most of them)."]
    return lines


def render_simulate(r: dict) -> list:
    o = r["json"]
    lb = o["layout_bound"]
    lines = [f"{o['model']}: {o['train']} -> {o['infer']} on `{o['cluster']}`. Every time here "
             f"is a **prediction** of the simulator under the constants below.", ""]
    lines += _table(["figure", "seconds"], [
        ("reshard, predicted", f"{o['predicted_s']:.3f}"),
        ("range with each uncertain constant halved or doubled, and the NICs at "
         + " or ".join(o.get("nic_efficiency_s", {})) + " of their datasheet rate",
         f"{o['sensitivity_range_s'][0]:.3f}-{o['sensitivity_range_s'][1]:.3f}"),
        *[(f"NICs at {e} of their datasheet rate (the collective library's efficiency, not "
           f"modelled)", f"{t:.3f}") for e, t in o.get("nic_efficiency_s", {}).items()],
        ("bound of the plan (its busiest NIC)", f"{o['bound_s']:.3f}"),
        ("bound from the layouts alone (each domain's distinct needed bytes over its own NICs)",
         f"{lb['bound_s']:.3f}"),
        ("direct point-to-point, predicted", f"{o['direct_s']:.3f}"),
        ("gather-broadcast, predicted", f"{o['gather_broadcast_s']:.3f}")])
    lines += ["", f"Plan's network bytes into every destination domain at least what the "
                  f"layouts need: {'yes' if o['plan_within_layout_bound'] else 'NO'}.", ""]
    sens = {s["name"]: s for s in o["sensitivity"]}
    rows = []
    for c in o["constants"]:
        s = sens.get(c["name"])
        rows.append((c["name"], f"{c['value']:.4g}", c["provenance"], c["source"],
                     "" if s is None else f"{s['half_s']:.3f} / {s['double_s']:.3f}"))
    lines += _table(["constant", "value", "provenance", "source", "predicted s at x0.5 / x2"],
                    rows)
    lines += ["", "Not modelled: " + "; ".join(o["not_modelled"]) + "."]
    return lines


def render_text(r: dict) -> list:
    return ["```", r["stdout"], "```"]


RENDER = {"peers": render_peers, "first-refit": render_first_refit, "replay": render_text,
          "calibrate": render_calibrate, "simulate": render_simulate,
          "delta": render_text, "delta-trace": render_text, "delta-simulate": render_text,
          "published": render_text, "shaped-peers": render_text,
          "shaped-calibrate": render_text, "shaped-delta": render_text,
          "shaped-delta-trace": render_text}
NOTES = {
    "peers": "Raw point-to-point is the group's own plain send of the same network bytes, source "
             "i to destination i, two messages in flight (bucket-sized or one per pair). It is "
             "a baseline, not a proven ceiling: where reshard's share exceeds 1, reshard's "
             "wire format (large items as their own messages, a wider window) moved the bytes "
             "faster than it. Where a goal is not met the table says so. Reshard does work the "
             "raw sends do not, on the same two cores that run the loopback network: it "
             "forwards the second replica's bytes inside the destination node (one copy per byte, "
             "which the receiving process makes straight out of the forwarder's memory; two, "
             "into a shared-memory ring and out of it, where the kernel refuses that), and "
             f"below {PER_ITEM_MIN_BYTES >> 10} KiB per item it packs and unpacks every item "
             "(two more copies per byte, and a per-item cost), besides each refit's check of every local tensor. The raw sends move the "
             "plan's network bytes once (256 MiB, into one destination each); the four "
             "destinations hold 512 MiB (two TP2 replicas), and reshard delivers all of it, the "
             "second replica by forwarding inside node 1. On a real cluster that forward "
             "crosses NVLink beside the NICs; here it costs copies on the two cores that also "
             "run the loopback network, so the 0.85 goal asks reshard to deliver twice the "
             "bytes in at most 1.18x the raw sends' time.",
    "replay": "`compile s` is a process's own share and program; the network turns, which the "
              "driver computes once and ships with the plan, are timed apart (`turns s`, on the "
              "first rank of a layout: the plan keeps them). Before they were timed apart, "
              "the compile column of a layout whose buckets go in turns included that "
              "driver-side work. `bind s` and the rebind columns bind as the runtime does, "
              "inside a refit with the cyclic collector paused; before, the first bind's "
              "column also held collector passes over the freshly built program, which a "
              "refit never runs.",
    "delta": "Every delta refit is checked bit-identical to the trainer's weights. The "
             "\"network\" here is loopback between two simulated nodes on the same two cores "
             "that compare, encode and decode, so a delta refit saves little time here however "
             "few bytes it sends; the shaped-link sections below measure it where a link is "
             "slower than memory, and [Delta refits](delta.md) gives the mechanism and the "
             "simulator's predictions for clusters whose NICs bound a refit.",
    "published": "Published figures exactly as their sources give them; every figure of ours "
                 "in that table is a prediction, with the assumptions printed above it.",
}


def render(results: dict, small: bool, facts: dict, commit: str) -> str:
    lines = ["# Benchmarks", "",
             "Generated by `python -m ray_reshard.tools.bench.report"
             + (" --small" if small else "") + "`; do not edit by hand. Every table below "
             "comes from the command printed above it (with when and at which commit it ran); "
             f"the machine facts below were read {facts['date_utc']} at commit `{commit}`."
             + ("" if small else " Each command's raw output is kept in "
                "`docs/benchmark-results/`; `python -m ray_reshard.tools.bench.report --check` reruns "
                "the commands whose figures are stated with a spread and says which of this "
                "run's figures fall inside their 95% predictions."),
             ""]
    if small:
        lines += ["**Small mode** (CI): tiny payloads and few repeats; these figures only show "
                  "the commands run, they are not the project's figures.", ""]
    lines += ["Machine: " + ", ".join(f"{k} {v}" for k, v in facts.items() if k != "date_utc")
              + ". The cores are shared with other work; each section's own spread shows how "
                "much that moved its figures.", ""]
    for name, r in results.items():
        load = r.get("load")
        lines += [f"## {SECTIONS[name][0]}", "",
                  f"`{r['command']}` (run {r.get('date_utc', '')} at commit "
                  f"`{r.get('commit', commit)}`, {r['seconds']:.0f} s"
                  + ("" if load is None else
                     f"; 1-minute load average {load[0]:.1f} at its start, {load[1]:.1f} at "
                     f"its end") + ("" if r.get("settled_s") is None else
                                   f"; started after {r['settled_s']:.0f} s waiting for the "
                                   f"CPUs to be under 25% busy over a second") + ")", ""]
        lines += RENDER[name](r)
        if name in NOTES:
            lines += ["", NOTES[name]]
        lines += [""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ checking
def stated_figures(name: str, r: dict) -> list:
    """The figures section `name`'s output `r` states with a spread, each as {"figure",
    "median", "low", "high", "met", "predicted"}: the goals of peers, first-refit and the delta
    sections (medians over runs or repeats, with the lowest and highest), the replay's run
    times (no goal: "met" is None) and the calibration's predicted / measured ratios; "predicted" is where a further run's figure would fall with 95%
    chance (`harness.predicted_range` of the runs' figures; None without several). Figures of
    a single measurement are left out: nothing states how far they move."""
    from .peers import goals

    o = r.get("json")
    if not isinstance(o, dict):
        return []
    if name in ("peers", "first-refit", "delta", "delta-trace"):
        found = [(g["goal"], g["measured"], g["low"], g["high"], g["met"], g.get("values"))
                 for g in (goals(o) if name == "peers" else o.get("goals", []))
                 if g.get("runs", 1) > 1]
    elif name == "replay":               # figures without a goal: no verdict to compare
        found = [(x["figure"], x["measured"], x["low"], x["high"], None, x["values"])
                 for x in o.get("figures", []) if x["runs"] > 1]
    elif name == "calibrate" and o.get("runs", 1) > 1:
        found = [(f"predicted / measured, {x['case']}", x["ratio"], x["low"], x["high"],
                  not x["miss"], x.get("ratios")) for x in o["summary"]]
    else:
        found = []
    return [{"figure": f, "median": m, "low": lo, "high": hi, "met": met,
             "predicted": _prediction(v)}
            for f, m, lo, hi, met, v in found]


CHECKED = ("peers", "first-refit", "replay", "calibrate", "delta", "delta-trace")  # page order


def compare(name: str, page: dict, fresh: dict) -> list:
    """Per figure the page states with a spread: the page's figure, this run's, whether this
    run's median falls inside the page's 95% prediction (`inside`) and inside its range of runs
    (`in_range`), and whether the goal verdict is the same. A figure this run does not state
    has None for this run and counts as outside."""
    now = {f["figure"]: f for f in stated_figures(name, fresh)}
    rows = []
    for f in stated_figures(name, page):
        g = now.get(f["figure"])
        pred = f["predicted"]
        rows.append({"section": name, "figure": f["figure"], "page": f, "now": g,
                     "inside": g is not None and pred is not None
                     and pred[0] <= g["median"] <= pred[1],
                     "in_range": g is not None and f["low"] <= g["median"] <= f["high"],
                     "same_verdict": g is not None and g["met"] == f["met"]})
    return rows


def check_text(rows: list, page_meta: dict) -> list:
    def fig(f):
        return "not stated" if f is None else \
            f"{f['median']:.2f} [{f['low']:.2f}-{f['high']:.2f}]"

    yes = lambda b: "yes" if b else "**no**"
    lines = _table(["figure", f"page ({page_meta})", PREDICTION, "this run",
                    "inside the prediction", "inside the page's range", "goal verdict"],
                   [(x["figure"], fig(x["page"]), _span_text(x["page"]["predicted"], "none"), fig(x["now"]),
                     yes(x["inside"]), yes(x["in_range"]),
                     "no goal" if x["page"]["met"] is None
                     else "same" if x["same_verdict"] else "**changed**") for x in rows])
    n_in = sum(x["inside"] for x in rows)
    n_range = sum(x["in_range"] for x in rows)
    return lines + ["", f"{n_in} of {len(rows)} figures inside the page's 95% prediction; "
                        f"{n_range} of {len(rows)} inside its range of runs."]


def _load_kept(keep: str, names: list) -> dict:
    results = {}
    for n in names:
        path = os.path.join(keep, f"{n}.out.json")
        if os.path.exists(path):
            with open(path) as f:
                results[n] = json.load(f)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ray_reshard.tools.bench.report",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="every command in its small mode")
    ap.add_argument("--out", help="the page to write (default docs/benchmarks.md); with "
                                  "--check, where to write the comparison as a page (default: "
                                  "printed only)")
    ap.add_argument("--sections", help=f"comma-separated, of {', '.join(SECTIONS)} (default: "
                                       f"all; with --check: {', '.join(CHECKED)})")
    ap.add_argument("--keep", help="directory for each command's raw output (default: "
                                   "docs/benchmark-results; with --check --out, "
                                   "docs/reproduction-results; else a temporary one with "
                                   "--small or --check)")
    ap.add_argument("--from", dest="source", help="render from a --keep directory (with --check: "
                                                  "compare its outputs), run nothing")
    ap.add_argument("--check", action="store_true",
                    help="rerun the sections and compare their figures with the kept page's")
    ap.add_argument("--against", default=RESULTS,
                    help="with --check: the kept outputs to compare with")
    args = ap.parse_args(argv)
    names = [n for n in (args.sections or ",".join(CHECKED if args.check else SECTIONS))
             .split(",") if n]
    bad = [n for n in names if n not in SECTIONS]
    if bad:
        ap.error(f"--sections: unknown {', '.join(bad)} (expected {', '.join(SECTIONS)})")
    if args.small:            # sections without a small mode are the long shaped-link runs
        names = [n for n in names if SECTIONS[n][2] is not None]
    import tempfile

    keep = args.source or args.keep or (
        tempfile.mkdtemp(prefix="ray-reshard-report-") if args.small
        else (REPRODUCTION if args.out else tempfile.mkdtemp(prefix="ray-reshard-check-"))
        if args.check else RESULTS)
    os.makedirs(keep, exist_ok=True)
    if args.check:
        page = _load_kept(args.against, names)
        if args.source:                  # this run's outputs kept earlier: compare, run nothing
            fresh = _load_kept(keep, names)
        else:
            _write_meta(keep, args.small)
            fresh = {}
            for n in names:
                print(f"running {command_line(n, args.small)}", flush=True)
                fresh[n] = run_section(n, args.small, keep)
        for where, got in ((args.against, page), (keep, fresh)):
            missing = [n for n in names if n not in got]
            if missing:
                ap.error(f"--check: {where} keeps no output of {', '.join(missing)}")
        rows = [x for n in names for x in compare(n, page[n], fresh[n])]
        stamp = ", ".join(sorted({f"`{r['commit']}` {r['date_utc']}" for r in page.values()}))
        table = check_text(rows, f"run at {stamp}")
        print("\n".join(table))
        print(f"this run's outputs: {keep}")
        if args.out:
            _write(args.out, check_page(table, names, args.small, keep))
        return 0 if all(x["inside"] for x in rows) else 1
    if args.source:
        with open(os.path.join(keep, "meta.json")) as f:
            meta = json.load(f)
    else:
        meta = _write_meta(keep, args.small)
        for n in names:
            print(f"running {command_line(n, args.small)}", flush=True)
            run_section(n, args.small, keep)
    # every section kept there, in page order: a rerun of some keeps the others' last figures
    results = _load_kept(keep, list(SECTIONS))
    _write(args.out or PAGE, render(results, meta["small"], meta["facts"], meta["commit"]))
    return 0


def _write_meta(keep: str, small: bool) -> dict:
    """The machine and commit a run starts on, kept beside its outputs."""
    meta = {"facts": machine_facts(), "commit": _commit(), "small": small}
    with open(os.path.join(keep, "meta.json"), "w") as f:
        json.dump(meta, f)
    return meta


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")
    print(f"wrote {path}")


def check_page(table: list, names: list, small: bool, keep: str) -> str:
    """The comparison of a `--check` run as a page: its commands (when, at which commit), the
    machine, then the table."""
    try:
        with open(os.path.join(keep, "meta.json")) as f:
            facts = json.load(f)["facts"]
        machine = ", ".join(f"{k} {v}" for k, v in facts.items() if k != "date_utc") + "."
    except FileNotFoundError:               # outputs kept without it: not this machine's now
        machine = "not recorded with these outputs."
    lines = ["# Reproducing the figures", "",
             "Generated by `python -m ray_reshard.tools.bench.report --check"
             + (" --small" if small else "") + " --out ...`; do not edit by hand. These "
             "commands ran again, on a fresh cluster of their own, and each figure that "
             "[Benchmark figures](benchmarks.md) states with a spread stands beside this run's. "
             "A figure is reproduced when this run's median falls inside the page's 95% "
             "prediction for a further run (Student's t over the page's runs or repeats, were "
             "their variation normal); the page's [range] (lowest and highest of its runs) is "
             "narrower and promises less.", ""]
    for n in names:
        with open(os.path.join(keep, f"{n}.out.json")) as f:
            r = json.load(f)
        lines.append(f"- `{r['command']}` (run {r['date_utc']} at commit `{r['commit']}`, "
                     f"{r['seconds']:.0f} s; 1-minute load average {r['load'][0]:.1f} at its start)")
    lines += ["", "Machine: " + machine]
    where = os.path.relpath(keep, ROOT)
    if not where.startswith(".."):
        lines += ["", f"This run's raw outputs are kept in `{where}/`."]
    return "\n".join(lines + [""] + table)


if __name__ == "__main__":
    raise SystemExit(main())
