"""What the benchmarks on the cluster in a box share (`ray_reshard.tools.netns_cluster`): running a
function in a box's driver, the layouts measured there, actors placed by node, each timed
run's link counters, and the link bound.

The link bound of a refit is its busiest link's bytes over the link's rate: the bytes the plan
sends out of, or into, the node whose link carries the most, in either direction (each
direction of a link has the full rate).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

MiB = 1 << 20


def run_in_box(target: str, kwargs: dict, *, nodes: int, rate: str, mtu: int = 9000,
               store_bytes: int = 512 * MiB, log=print) -> dict:
    """Start a box of `nodes` nodes at `rate`, run `target(**kwargs)` in its driver (its output
    shown here), close the box; returns what the target returned."""
    from ..netns_cluster import NetnsCluster

    box = NetnsCluster(nodes=nodes, rate=rate, mtu=mtu, store_bytes=store_bytes)
    t0 = time.perf_counter()
    with box:
        log(f"cluster in a box: {nodes} Ray nodes in network namespaces, each link shaped to "
            f"{rate} each way (MTU {mtu}), started in {time.perf_counter() - t0:.0f} s",
            flush=True)
        return box.driver(echo=True).call(target, call_timeout_s=24 * 3600, **kwargs)


def layouts():
    """name -> (description, source layout of tensor i, destination layout, source node per
    rank, destination node per rank, tensor shape kind for `specs`): the refits measured on a
    box of 3 nodes. Each node holds at most 4 ranks of a side, 4 where it holds a whole side
    (the `shaped` simulator preset gives each rank a quarter of its node's link)."""
    import ray_reshard as rr
    from ray_reshard.layout.placement import Replicate, Shard

    L = lambda ranks, *p, names=None: rr.Layout(rr.Mesh(ranks, names), p)
    tp4 = L([0, 1, 2, 3], Shard(0))
    tp4c = L([0, 1, 2, 3], Shard(1))
    tp2dp2 = L([[0, 1], [2, 3]], Replicate(), Shard(0), names=("dp", "tp"))
    stage2 = [L([0, 1], Shard(0), names=("tp",)), L([2, 3], Shard(0), names=("tp",))]
    stage4 = [L([0, 1, 2, 3], Shard(0), names=("tp",)),
              L([4, 5, 6, 7], Shard(0), names=("tp",))]
    ep4 = L([0, 1, 2, 3], Shard(0), names=("ep",))
    ep2tp2 = L([[0, 1], [2, 3]], Shard(0), Shard(1), names=("ep", "tp"))
    dp2tp4c = L([[0, 1, 2, 3], [4, 5, 6, 7]], Replicate(), Shard(1), names=("dp", "tp"))
    return {
        "TP4 -> TP2xDP2, 2 nodes": (
            "TP4 (4 actors, node 0) -> TP2 x DP2 (4 actors, node 1)",
            lambda i: tp4, tp2dp2, [0] * 4, [1] * 4, "rows"),
        "PP2xTP2 -> TP4, 3 nodes": (
            "PP2 x TP2 (stage 0 on node 0, stage 1 on node 1; each tensor on one stage) -> "
            "TP4 (node 2)", lambda i: stage2[i % 2], tp4, [0, 0, 1, 1], [2] * 4, "rows"),
        "EP4 -> EP2xTP2, 3 nodes": (
            "EP4 (experts stacked on dim 0; ranks 0-1 on node 0, 2-3 on node 1) -> EP2 x TP2 "
            "(node 2)", lambda i: ep4, ep2tp2, [0, 0, 1, 1], [2] * 4, "experts"),
        "TP4 -> TP2xDP2 across nodes 1 and 2": (
            "TP4 (node 0) -> TP2 x DP2 (replica 0 on node 1, replica 1 on node 2)",
            lambda i: tp4, tp2dp2, [0] * 4, [1, 1, 2, 2], "rows"),
        "TP4 rows -> TP4 cols, 3 nodes": (
            "TP4 by rows (ranks 0-1 on node 0, 2-3 on node 1) -> TP4 by columns (node 2)",
            lambda i: tp4, tp4c, [0, 0, 1, 1], [2] * 4, "rows"),
        "TP4 -> TP2xDP2 uneven, 2 nodes": (
            "TP4 -> TP2 x DP2 of tensors whose rows do not divide (uneven shards both sides; "
            "node 0 -> node 1)", lambda i: tp4, tp2dp2, [0] * 4, [1] * 4, "uneven"),
        "PP2xTP4 -> TP2xDP2, 3 nodes": (
            "PP2 x TP4 (stage 0 on node 0, stage 1 on node 1) -> TP2 x DP2 (node 2)",
            lambda i: stage4[i % 2], tp2dp2, [0] * 4 + [1] * 4, [2] * 4, "rows"),
        "TP4 -> DP2xTP4 cols, 3 nodes": (
            "TP4 by rows (node 0) -> DP2 x TP4 by columns (replica 0 on node 1, replica 1 on "
            "node 2)", lambda i: tp4, dp2tp4c, [0] * 4, [1] * 4 + [2] * 4, "rows"),
    }


def specs(name: str, mb: int, count: int, dtype=torch.float32) -> dict:
    """`count` tensors of layout `name` making `mb` MiB: rows x 1024 (rows a multiple of 4; a
    multiple of 4 minus 1 for "uneven"), or 4 experts of rows x 256."""
    import ray_reshard as rr

    _, src_of, dst, _, _, shape = layouts()[name]
    isz = torch.tensor([], dtype=dtype).element_size()
    rows = (mb * MiB) // (count * 1024 * isz)
    rows -= rows % 4
    if rows < 4:
        raise ValueError(f"{mb} MiB over {count} tensors leaves fewer than 4 rows of 1024 "
                         f"per tensor ({name})")
    if shape == "uneven":
        rows -= 1
    dims = (4, rows, 256) if shape == "experts" else (rows, 1024)
    return {f"w{i}": rr.TensorSpec(dims, dtype, src_of(i), dst) for i in range(count)}


def holder_class():
    import ray

    @ray.remote(num_cpus=0)
    class Holder:
        """Holds named tensors, made in place (no payload crosses from the driver)."""

        def __init__(self):
            self.t = {}

        def make(self, shapes, seed: int, fill: bool = True):
            g = torch.Generator().manual_seed(seed)
            self.t = {n: (torch.randn(s, generator=g) if fill else torch.zeros(s))
                      for n, s in shapes.items()}

        def change(self, fraction: float, seed: int):
            """Add 1 to `fraction` of every tensor's elements (an optimizer step's changes)."""
            g = torch.Generator().manual_seed(seed)
            for t in self.t.values():
                flat = t.view(-1)
                k = int(flat.numel() * fraction)
                flat[torch.randperm(flat.numel(), generator=g)[:k]] += 1.0

        def reshard_tensors(self):
            return self.t

        def digest(self):
            return float(sum(float(t.double().sum()) for t in self.t.values()))

    return Holder


def place(src_nodes, dst_nodes, cls=None) -> tuple[list, list]:
    """Actors on the box's nodes (`rr.on_node`): sources on `src_nodes[r]`, destinations on
    `dst_nodes[r]`."""
    import ray_reshard as rr

    cls = cls or holder_class()
    return ([cls.options(**rr.on_node(n)).remote() for n in src_nodes],
            [cls.options(**rr.on_node(n)).remote() for n in dst_nodes])


def fill(src, dst, spec_set: dict, seed: int = 1) -> None:
    """Each source makes its shards (random), each destination zeros of its shape."""
    import ray

    shapes = lambda side, r: {n: s.layout(side).local_shape(r, s.shape)
                              for n, s in spec_set.items()
                              if s.layout(side).box(r, s.shape) is not None}
    ray.get([a.make.remote(shapes("src", r), seed + r) for r, a in enumerate(src)] +
            [a.make.remote(shapes("dst", r), 0, False) for r, a in enumerate(dst)])


def link_bytes(plan) -> dict:
    """{box node: [bytes out of it, bytes into it]} that `plan` sends over the network."""
    from ..netns_cluster import node_indices
    from ..plan_report import traffic

    t = traffic(plan)
    index = node_indices()
    out = {i: [0, 0] for i in sorted(set(index.values()))}
    for a, row in zip(t["domains"]["src"], t["domain_network_bytes"]):
        for b, nbytes in zip(t["domains"]["dst"], row):
            out[index[a]][0] += nbytes
            out[index[b]][1] += nbytes
    return out


def busiest_link(per_node: dict) -> int:
    """The most bytes any link carries in one direction."""
    return max((max(v) for v in per_node.values()), default=0)


# The head node's link as the driver (in the head's namespace) sees it: bytes out of node 0.
HEAD_TX = "/sys/class/net/rrbox-eth/statistics/tx_bytes"


class Counted:
    """Runs a callable with every link's kernel counters read around it and, with `timeline`,
    node 0's outgoing bytes sampled every millisecond meanwhile (see `idle_link`)."""

    def __init__(self, timeline: bool = True):
        import os

        from ..netns_cluster import links
        self.links = links()
        self.timeline = timeline and os.path.exists(HEAD_TX)
        self.last_timeline: Optional[dict] = None

    def __call__(self, fn: Callable[[], float]) -> tuple[float, dict]:
        """(what `fn` returned, {node: [bytes out, bytes in]} the links carried meanwhile)."""
        import threading

        before = self.links.counters()
        samples, stop = [], threading.Event()

        def sample():
            with open(HEAD_TX) as f:
                while not stop.is_set():
                    f.seek(0)
                    samples.append((time.perf_counter(), int(f.read())))
                    time.sleep(0.001)
        th = threading.Thread(target=sample, daemon=True) if self.timeline else None
        if th:
            th.start()
        t0 = time.perf_counter()
        value = fn()
        t1 = time.perf_counter()
        if th:
            stop.set()
            th.join()
            self.last_timeline = idle_link(samples, t0, t1)
        d = self.links.delta(before, self.links.counters())
        return value, {i: [c["tx_bytes"], c["rx_bytes"]] for i, c in d.items()}


def idle_link(samples: list, t0: float, t1: float) -> Optional[dict]:
    """From (time, bytes out of node 0) samples around a call from `t0` to `t1`: milliseconds
    from the call to the link's first 1% of the call's bytes ("before_ms"), the link's busy
    time up to 99.9% of them ("busy_ms"), and from there to the call's end ("after_ms")."""
    inside = [(t, b) for t, b in samples if t0 <= t <= t1]
    if len(inside) < 2 or inside[-1][1] <= inside[0][1]:
        return None
    base, total = inside[0][1], inside[-1][1] - inside[0][1]
    start = next(t for t, b in inside if b - base >= 0.01 * total)
    end = next(t for t, b in inside if b - base >= 0.999 * total)
    return {"before_ms": (start - t0) * 1e3, "busy_ms": (end - start) * 1e3,
            "after_ms": (t1 - end) * 1e3}


def rate_Bps(rate: str) -> float:
    from ..netns_cluster import rate_bytes_per_s
    return rate_bytes_per_s(rate)


def set_rate(rate: str) -> None:
    """Every link of the box this driver runs in to `rate`, both ways."""
    from ..netns_cluster import links

    L = links()
    for i in range(len(L.spec.nodes)):
        L.set_rate(i, rate)


def timed_refits(group, spec_set, repeats: int, counted: Optional[Counted] = None,
                 delta: bool = False, between: Optional[Callable] = None) -> dict:
    """`repeats` refits after a warm-up (two for delta: the first has no baseline), each
    timed and, with `counted`, with its links' bytes; `between()` runs before each (e.g. to
    change the sources). {"seconds": [...], "wire": [per-run {node: [out, in]}], "result"}"""
    from .harness import settle

    group.refit(spec_set, delta=delta)
    if delta:
        if between:
            between()
        group.refit(spec_set, delta=True)
    out = {"seconds": [], "wire": []}
    for _ in range(repeats):
        if between:
            between()
        settle()

        def run():
            t0 = time.perf_counter()
            out["result"] = group.refit(spec_set, delta=delta)
            return time.perf_counter() - t0
        if counted is None:
            out["seconds"].append(run())
        else:
            s, w = counted(run)
            out["seconds"].append(s)
            out["wire"].append(w)
    return out
