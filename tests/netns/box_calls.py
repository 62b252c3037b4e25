"""Functions the shaped-cluster tests run inside the box's driver (the head's namespace).

Each returns plain data (JSON) for the test to assert on. Actors are made once per layout and
kept for the driver's life, so the tests share them.
"""
from __future__ import annotations

import os
import subprocess
import threading
import time

import ray
import torch

import ray_reshard as rr
from ray_reshard.tools.netns_cluster import NODE_IF, links, node_indices
from ray_reshard.tools.plan_report import traffic
from ray_reshard.tools.testing import Holder

_RIGS: dict = {}


def layouts(where: str):
    """(source layout, destination layout, source node per rank, destination node per rank):
    `"1"`: TP4 on node 0 -> TP2 x DP2 on node 1; `"1+2"`: the same, each DP replica on its own
    node (1 and 2)."""
    tp4 = rr.Layout(rr.Mesh([0, 1, 2, 3], ("tp",)), (rr.Shard(0),))
    tp2dp2 = rr.Layout(rr.Mesh([[0, 1], [2, 3]], ("dp", "tp")), (rr.Replicate(), rr.Shard(0)))
    dst_nodes = [1, 1, 1, 1] if where == "1" else [1, 1, 2, 2]
    return tp4, tp2dp2, [0] * 4, dst_nodes


def _rig(where: str, mb: int, count: int):
    key = (where, mb, count)
    if key not in _RIGS:
        src_l, dst_l, src_nodes, dst_nodes = layouts(where)
        rows = (mb << 20) // (count * 1024 * 4)
        specs = {f"w{i}": rr.TensorSpec((rows, 1024), torch.float32, src_l, dst_l)
                 for i in range(count)}
        src = [Holder.options(**rr.on_node(n)).remote() for n in src_nodes]
        dst = [Holder.options(**rr.on_node(n)).remote() for n in dst_nodes]
        ray.get([a.set.remote({n: torch.zeros(dst_l.local_shape(r, s.shape))
                               for n, s in specs.items()}) for r, a in enumerate(dst)])
        _RIGS[key] = (specs, src, dst, src_l, dst_l)
    return _RIGS[key]


def _fill(src, specs, src_l, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(s.shape, generator=g) for n, s in specs.items()}
    ray.get([a.set.remote({n: rr.shard_tensor(full[n], src_l, r) for n in specs})
             for r, a in enumerate(src)])
    return full


def _holds(dst, specs, full, dst_l) -> list:
    """Per destination rank: whether it holds its shards of `full` exactly."""
    got = ray.get([a.get.remote() for a in dst], timeout=60)
    return [all(torch.equal(got[r][n], rr.shard_tensor(full[n], dst_l, r)) for n in specs)
            for r in range(len(dst))]


def _change(actor, fraction: float, seed: int) -> bool:
    """Add 1 to `fraction` of every source tensor's elements (an optimizer step's changes)."""
    g = torch.Generator().manual_seed(seed)
    for t in actor.tensors.values():
        flat = t.view(-1)
        flat[torch.randperm(flat.numel(), generator=g)[:int(flat.numel() * fraction)]] += 1.0
    return True


def info() -> dict:
    """What the cluster looks like from inside: nodes, their resources and addresses, each
    node's interfaces and the link name gloo uses there."""
    L = links()

    @ray.remote(num_cpus=0)
    def where():
        return {"ip": ray.util.get_node_ip_address(),
                "gloo_if": os.environ.get("GLOO_SOCKET_IFNAME"),
                "ifaces": sorted(os.listdir("/sys/class/net"))}

    nodes = {n["NodeManagerAddress"]: sorted(k for k in n["Resources"] if k.startswith("node")
                                             and k[4:].isdigit())
             for n in ray.nodes() if n.get("Alive")}
    on = ray.get([where.options(**rr.on_node(i)).remote() for i in range(len(L.spec.nodes))])
    ifaces = {n.index: sorted(d["ifname"] for d in __import__("json").loads(subprocess.run(
        ["ip", "-n", n.netns, "-j", "link", "show"], capture_output=True, text=True).stdout))
        for n in L.spec.nodes}
    return {"nodes": nodes, "on_node": on, "ifaces": ifaces, "node_if": NODE_IF,
            "rates": [L.rate(i) for i in range(len(L.spec.nodes))],
            "driver_gloo_if": os.environ.get("GLOO_SOCKET_IFNAME")}


def wire(kind: str, mb: int = 32, count: int = 32, fraction: float = 0.1) -> dict:
    """One refit of `kind` ("dense", "delta", "gather_broadcast") of TP4 on node 0 -> TP2 x DP2
    on node 1, after a warm-up, with every link's kernel counters read around it: what the
    result reports, what the plan says enters and leaves each node, what each link carried."""
    L = links()
    specs, src, dst, src_l, dst_l = _rig("1", mb, count)
    strategy = "gather_broadcast" if kind == "gather_broadcast" else "reshard"
    delta = kind == "delta"
    full = _fill(src, specs, src_l, 1)
    with rr.ReshardGroup(src, dst, strategy=strategy) as g:
        g.refit(specs, delta=delta)
        if delta:           # the first delta refit is dense (no baseline): a second one
            ray.get([a.__ray_call__.remote(_change, fraction, i) for i, a in enumerate(src)])
            g.refit(specs, delta=True)
        ray.get([a.__ray_call__.remote(_change, fraction, 10 + i) for i, a in enumerate(src)])
        full = {n: t for n, t in _gather(src, specs, src_l).items()}
        before = L.counters()
        t0 = time.perf_counter()
        res = g.refit(specs, delta=delta)
        seconds = time.perf_counter() - t0
        carried = L.delta(before, L.counters())
        plan = g.plan(specs)
    t = traffic(plan)
    index = node_indices()
    expect_tx = {i: 0 for i in carried}
    expect_rx = {i: 0 for i in carried}
    for a, row in zip(t["domains"]["src"], t["domain_network_bytes"]):
        for b, nbytes in zip(t["domains"]["dst"], row):
            expect_tx[index[a]] += nbytes
            expect_rx[index[b]] += nbytes
    return {"kind": kind, "seconds": seconds, "reported": res.bytes_by_path,
            "plan_network_bytes": plan.stats.network_bytes, "expect_tx": expect_tx,
            "expect_rx": expect_rx, "carried": carried,
            "exact": all(_holds(dst, specs, full, dst_l)), "rate": L.rate(1)}


def _gather(src, specs, src_l) -> dict:
    """The full tensors the sources hold now."""
    got = ray.get([a.get.remote() for a in src])
    out = {}
    for n, s in specs.items():
        full = torch.empty(s.shape)
        for r in range(len(src)):
            full[s.src.box(r, s.shape).slices()] = got[r][n]
        out[n] = full
    return out


def fault(kind: str, mb: int = 16, count: int = 16, timeout_s: float = 6.0,
          after_s: float = 0.15, hold_s: float = 0.0) -> dict:
    """An atomic refit of TP4 (node 0) -> TP2 x DP2 (replica 0 on node 1, replica 1 on node 2)
    meeting a network fault on node 2's link: "down" (taken down `after_s` into the refit),
    "partition" (node 2 cut off from the head, likewise), "delay" (200 ms each way) or "loss"
    (2% of frames each way), both from before the refit. The link comes back once the refit
    ended (after `hold_s` more); then the group's versions, what each destination holds, and
    the next refit on the same group."""
    L = links()
    specs, src, dst, src_l, dst_l = _rig("1+2", mb, count)
    out = {"kind": kind, "timeout_s": timeout_s}
    g = rr.ReshardGroup(src, dst, timeout_s=timeout_s)
    try:
        old = _fill(src, specs, src_l, 1)
        g.refit(specs, atomic=True)
        out["version_before"] = g.version
        new = _fill(src, specs, src_l, 2)
        if kind == "delay":
            L.impair(2, delay_ms=200)
        elif kind == "loss":
            L.impair(2, loss=0.02)
        ended = {}

        def run():
            t0 = time.monotonic()
            try:
                ended["version"] = g.refit(specs, atomic=True).version
            except Exception as e:      # noqa: BLE001  (reported to the test)
                ended["error"] = f"{type(e).__name__}: {e}"
                ended["failed_ranks"] = [list(r) for r in getattr(e, "failed_ranks", ())]
            ended["seconds"] = time.monotonic() - t0

        th = threading.Thread(target=run)
        th.start()
        if kind in ("down", "partition"):
            time.sleep(after_s)
            (L.link_down if kind == "down" else L.partition)(2)
        th.join()
        out.update(ended)
        time.sleep(hold_s)
        L.restore(2)
        out["versions"] = g.versions()          # every member reachable again
        out["group_version"] = g.version
        out["holds_old"] = _holds(dst, specs, old, dst_l)
        out["holds_new"] = _holds(dst, specs, new, dst_l)
        t0 = time.monotonic()
        res = g.refit(specs, atomic=True)
        out["next"] = {"version": res.version, "seconds": time.monotonic() - t0,
                       "warnings": res.warnings, "holds_new": _holds(dst, specs, new, dst_l)}
    finally:
        L.restore(2)
        g.close()
    return out


def lower_bound_check(mb: int = 32) -> dict:
    """A dense refit's seconds beside its busiest link's bytes over the link's rate (the
    shaping holds: no refit beats the link)."""
    from ray_reshard.tools.netns_cluster import rate_bytes_per_s

    L = links()
    specs, src, dst, src_l, dst_l = _rig("1", mb, 32)
    _fill(src, specs, src_l, 3)
    with rr.ReshardGroup(src, dst) as g:
        g.refit(specs)
        t0 = time.perf_counter()
        g.refit(specs)
        seconds = time.perf_counter() - t0
        network = g.plan(specs).stats.network_bytes
    return {"seconds": seconds, "bound_s": network / rate_bytes_per_s(L.spec.rate)}


def fails(text: str) -> None:
    raise ValueError(text)
