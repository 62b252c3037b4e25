"""One case of the peers benchmark: every peer at one tensor count on the same actors (the
actor that holds and moves tensors each peer's way, the warm-up that checks each peer's result
against reshard's, the timed rounds in rotated order). Loopback and shaped runs both use it."""
from __future__ import annotations

import time
from typing import Optional

import torch

from .harness import SETTLE_LIMIT_S, MiB, Spread, raw_bandwidth, settle

COLS = 1024
RAW = ("raw point-to-point, bucket-sized messages", "raw point-to-point, one message per pair")
RDT = "Ray Direct Transport (gloo)"
RDT_FLAT = "Ray Direct Transport (gloo), one flat tensor per source"
PEERS = ("reshard", "object store", RDT, "gather-broadcast") + RAW
# The fair pair of raw point-to-point (loopback): the same pairs and bytes as the raw sends,
# and the raw sends plus the forward inside the destination node.
FAIR = ("reshard TP4 -> TP4 (the raw sends' pairs and bytes)",
        "raw point-to-point + forward to the second replica")
FORWARD = "forward to the second replica (a refit of replica 0 into replica 1)"
# Reshard's rise with the tensor count is measured inside the larger count's case: the same
# bytes in fewer tensors, on the same actors, in the same turns.
RISE_BASE = "reshard, the same bytes in fewer tensors (the rise's baseline)"
EXTRA = (RDT_FLAT, FAIR[0], FORWARD, RISE_BASE)
GB_BUCKET_MB = 16             # gather-broadcast's bucket (whole tensors per collective), at least


def shape_for(mb: int, count: int) -> tuple[int, int]:
    """(rows, 1024) fp32 tensors, `count` of them making `mb` MiB; rows a multiple of 4."""
    rows = (mb * MiB) // (count * COLS * 4)
    if rows < 4 or rows % 4:
        raise ValueError(f"--mb {mb} over {count} tensors gives {rows} rows of {COLS} fp32 "
                         f"each: expected a positive multiple of 4 (TP4 row shards)")
    return rows, COLS


def holder_class():
    import ray

    @ray.remote(num_cpus=0)
    class Holder:
        """Holds named tensors; exports and absorbs them the ways the peers move them."""

        def __init__(self):
            self.t = {}

        def make(self, shapes, fill):
            g = torch.Generator().manual_seed(1)
            self.t = {n: (torch.randn(s, generator=g) if fill else torch.zeros(s))
                      for n, s in shapes.items()}

        def zero(self):
            for t in self.t.values():
                t.zero_()

        def reshard_tensors(self):
            return self.t

        def export(self, names):
            return [self.t[n].numpy() for n in names]

        @ray.method(tensor_transport="gloo")
        def export_tensors(self, names):
            return [self.t[n] for n in names]

        @ray.method(tensor_transport="gloo")
        def export_flat(self, names):
            return torch.cat([self.t[n].view(-1) for n in names])

        def absorb_flat(self, names, *flats):
            # flats: one flat tensor per source covering this rank's rows, in row order
            offs = [0] * len(flats)
            for n in names:
                dst = self.t[n]
                row = 0
                for k, flat in enumerate(flats):
                    rows = dst.shape[0] // len(flats)
                    count = rows * dst.shape[1]
                    dst[row:row + rows].copy_(flat[offs[k]:offs[k] + count].view(rows, -1))
                    offs[k] += count
                    row += rows
            return True

        def add(self, shapes, fill=False):
            """More tensors beside the ones it holds (zeros, or random with `fill`)."""
            g = torch.Generator().manual_seed(2)
            self.t.update({n: (torch.randn(s, generator=g) if fill else torch.zeros(s))
                           for n, s in shapes.items()})

        def alias(self, names):
            """Its tensors also under other names ({new: existing}; no copy)."""
            self.t.update({new: self.t[old] for new, old in names.items()})

        def absorb(self, names, *parts):
            # parts: the source objects covering this rank's rows, in row order
            for i, n in enumerate(names):
                dst = self.t[n]
                row = 0
                for part in parts:
                    a = torch.as_tensor(part[i])
                    dst[row:row + a.shape[0]].copy_(a)
                    row += a.shape[0]
            return True

        def digest(self, names):
            return float(sum(float(self.t[n].double().sum()) for n in names))

    return Holder


def rdt_group(actors):
    """A gloo collective group of `actors` for Ray Direct Transport, or the reason there is
    none on this Ray."""
    try:
        from ray.experimental.collective import create_collective_group
    except ImportError as e:
        return None, f"Ray {__import__('ray').__version__} has no Ray Direct Transport ({e})"
    try:
        return create_collective_group(actors, backend="torch_gloo"), ""
    except Exception as e:                        # an alpha API: report, do not hide
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def run_case(src, dst, count: int, mb: int, bucket_mb: int, repeats: int, rdt, log=print,
             fair: bool = False, counted=None, rise_from: Optional[int] = None
             ) -> tuple[dict, str]:
    """Every peer at one tensor count on the same actors: warm-up (each result checked against
    reshard's), then `repeats` rounds of timed runs in rotated order; with `counted`
    (`shaped.Counted`) each run's link bytes too; with `rise_from`, also reshard over the same
    bytes in that many tensors (`RISE_BASE`). Returns the row and why Ray Direct Transport
    stopped ("" when it ran)."""
    import ray_reshard as rr

    rows, cols = shape_for(mb, count)
    names = [f"w{i}" for i in range(count)]
    specs, fair_specs, fwd_specs = case_specs(src, dst, rows, cols, count, fair)
    base_specs = None if rise_from is None else \
        fewer_specs(src, dst, shape_for(mb, rise_from), rise_from)
    bucket = bucket_mb * MiB
    g = rr.ReshardGroup(src, dst, bucket_bytes=bucket)
    # gather-broadcast's collectives gain from large buckets: never under 16 MiB
    gb = rr.ReshardGroup(src, dst, strategy="gather_broadcast",
                         bucket_bytes=max(bucket, GB_BUCKET_MB * MiB))
    whole = fwd = None
    try:
        network = g.plan(specs).stats.network_bytes
        per_pair = max(1, network // 4)
        whole = rr.ReshardGroup(src, dst, bucket_bytes=per_pair)   # one message a pair
        if fair:
            fwd = rr.ReshardGroup(dst[:2], dst[2:], bucket_bytes=bucket)
        peers = {"reshard": timed_refit(g, specs),
                 "object store": timed_through(src, dst, names,
                                               lambda a: a.export.remote(names)),
                 "gather-broadcast": timed_refit(gb, specs),
                 RAW[0]: timed_raw(g, per_pair), RAW[1]: timed_raw(whole, per_pair)}
        if rdt:
            peers[RDT] = timed_through(src, dst, names, lambda a: a.export_tensors.remote(names))
            peers[RDT_FLAT] = timed_through(src, dst, names,
                                            lambda a: a.export_flat.remote(names), "absorb_flat")
        if fair:
            peers[FAIR[0]] = timed_refit(g, fair_specs)
            peers[FORWARD] = timed_refit(fwd, fwd_specs)
        if base_specs is not None:
            peers[RISE_BASE] = timed_refit(g, base_specs)
        why_not_rdt = warm_up(peers, dst, names, count, log)
        if base_specs is not None:
            check_fewer(src, dst, list(base_specs), count)
        times, wire, idle, waits = timed_rounds(peers, repeats, counted)
        plan = g.plan(specs)
    finally:
        for group in (g, gb, whole, fwd):
            if group is not None:
                group.close()
    row = {"tensors": count, "shape": [rows, cols], "network_bytes": network,
           "raw_bytes": per_pair * 4, "peers": {n: Spread(v).as_dict()
                                                for n, v in times.items()}}
    if counted is not None:
        from .shaped import link_bytes
        row["plan_links"] = {str(i): v for i, v in link_bytes(plan).items()}
        row["wire"] = {n: [{str(i): v for i, v in w.items()} for w in ws]
                       for n, ws in wire.items()}
        # where a timed run's time went: before node 0's link started, while it carried the
        # bytes, after it finished (medians over the repeats)
        row["link_timeline"] = {n: {k: Spread([x[k] for x in xs]).median for k in xs[0]}
                                for n, xs in idle.items() if xs}
    row["settle"] = {"runs": len(waits), "waited_s": round(sum(waits), 2),
                     "not_quiet": sum(w >= SETTLE_LIMIT_S for w in waits)}
    if base_specs is not None:
        # each round ran both once: the rise is the median of the rounds' differences
        row["rise"] = {"from": rise_from, "to": count, "ms_by_round": [
            1e3 * (a - b) for a, b in zip(times["reshard"], times[RISE_BASE])]}
    return row, why_not_rdt


def case_specs(src, dst, rows: int, cols: int, count: int, fair: bool):
    """The case's specs (TP4 -> TP2 x DP2), with the actors' tensors made for them; with `fair`
    also the fair pair's (TP4 -> TP4 into tensors of their own, and the forward of the first
    replica into the second inside the destination node), else None for those."""
    import ray

    import ray_reshard as rr
    from ray_reshard.layout.placement import Shard

    L = lambda ranks, *p, names=None: rr.Layout(rr.Mesh(ranks, names), p)
    src_l, dst_l = case_layouts()
    names = [f"w{i}" for i in range(count)]
    specs = {n: rr.TensorSpec((rows, cols), torch.float32, src_l, dst_l) for n in names}
    shapes = lambda spec_set, side, r: {n: s.layout(side).local_shape(r, s.shape)
                                        for n, s in spec_set.items()}
    ray.get([a.make.remote(shapes(specs, "src", r), True) for r, a in enumerate(src)])
    ray.get([a.make.remote(shapes(specs, "dst", r), False) for r, a in enumerate(dst)])
    if not fair:
        return specs, None, None
    # source i sends its shard to destination i
    fair_specs = {f"p{i}": rr.TensorSpec((rows, cols), torch.float32, src_l, src_l)
                  for i in range(count)}
    ray.get([a.add.remote(shapes(fair_specs, "dst", r)) for r, a in enumerate(dst)] +
            [a.alias.remote({f"p{i}": f"w{i}" for i in range(count)}) for a in src])
    tp2 = L([0, 1], Shard(0), names=("tp",))
    fwd_specs = {n: rr.TensorSpec((rows, cols), torch.float32, tp2, tp2) for n in names}
    return specs, fair_specs, fwd_specs


def case_layouts():
    """The case's source (TP4) and destination (TP2 x DP2) layouts."""
    import ray_reshard as rr
    from ray_reshard.layout.placement import Replicate, Shard

    return (rr.Layout(rr.Mesh([0, 1, 2, 3]), (Shard(0),)),
            rr.Layout(rr.Mesh([[0, 1], [2, 3]], ("dp", "tp")), (Replicate(), Shard(0))))


def fewer_specs(src, dst, shape: tuple, count: int) -> dict:
    """Specs of the case's layouts over `count` more tensors (`f0`...) of `shape`, made on the
    actors beside the case's own (sources random, destinations zeros)."""
    import ray

    import ray_reshard as rr

    src_l, dst_l = case_layouts()
    specs = {f"f{i}": rr.TensorSpec(shape, torch.float32, src_l, dst_l) for i in range(count)}
    shapes = lambda side, r: {n: s.layout(side).local_shape(r, s.shape) for n, s in specs.items()}
    ray.get([a.add.remote(shapes("src", r), True) for r, a in enumerate(src)] +
            [a.add.remote(shapes("dst", r)) for r, a in enumerate(dst)])
    return specs


def check_fewer(src, dst, names: list, count: int) -> None:
    """After `fewer_specs`' refit: each destination replica holds what the sources hold."""
    import numpy as np
    import ray

    want = sum(ray.get([a.digest.remote(names) for a in src]))
    got = ray.get([a.digest.remote(names) for a in dst])    # TP2 x DP2: replicas [0, 1], [2, 3]
    if not np.allclose([got[0] + got[1], got[2] + got[3]], want, rtol=1e-9, atol=1e-6):
        raise RuntimeError(f"{count} tensors: the rise's baseline left {got} on the "
                           f"destinations (replica sums), the sources hold {want}")


def timed_refit(group, spec_set):
    """A timed run of `group.refit(spec_set)`."""
    def run():
        t0 = time.perf_counter()
        group.refit(spec_set)
        return time.perf_counter() - t0
    return run


def timed_through(src, dst, names, export, absorb="absorb"):
    """A timed run of a peer that moves objects: each source exports, each destination takes the
    two covering its rows."""
    import ray

    def run():
        t0 = time.perf_counter()
        refs = [export(a) for a in src]
        # destination rank d = dp * 2 + tp holds rows of sources 2 tp, 2 tp + 1
        ray.get([getattr(a, absorb).remote(names, refs[2 * (d % 2)], refs[2 * (d % 2) + 1])
                 for d, a in enumerate(dst)])
        del refs
        return time.perf_counter() - t0
    return run


def timed_raw(group, per_pair: int):
    """A timed run of raw point-to-point over `group`'s transport, `per_pair` bytes a pair."""
    def run():
        t0 = time.perf_counter()
        raw_bandwidth(group, per_pair)
        return time.perf_counter() - t0
    return run


def warm_up(peers: dict, dst, names, count: int, log) -> str:
    """One run of each peer, each refit peer's result checked against reshard's; a Ray Direct
    Transport peer that fails (an alpha API) is reported and dropped from `peers`. Returns why
    it stopped ("" when it ran)."""
    import numpy as np
    import ray

    want = None
    why_not_rdt = ""
    for name, fn in list(peers.items()):
        if name in RAW or name in FAIR or name in (FORWARD, RISE_BASE):
            fn()
            continue
        ray.get([a.zero.remote() for a in dst])
        try:
            fn()
        except Exception as e:
            if name not in (RDT, RDT_FLAT):
                raise
            del peers[name]
            why_not_rdt = (f"{name} failed at {count} tensors: {type(e).__name__}: "
                           f"{str(e).splitlines()[-1][:200] if str(e) else ''}")
            log(why_not_rdt)
            continue
        got = ray.get([a.digest.remote(names) for a in dst])
        if want is None:
            want = got
        elif not np.allclose(want, got, rtol=1e-9, atol=1e-6):
            raise RuntimeError(f"{count} tensors: {name} left {got} on the destinations, "
                               f"reshard {want}")
    return why_not_rdt


def timed_rounds(peers: dict, repeats: int, counted):
    """`repeats` rounds of every peer; each round rotates the order, so no peer always runs
    right after the same one, and each timed run starts once the machine is quiet again.
    Returns each peer's seconds, link bytes and link timelines (with `counted`), and the waits."""
    times = {name: [] for name in peers}
    wire = {name: [] for name in peers}
    idle = {name: [] for name in peers}
    order = list(peers)
    waits = []
    for k in range(repeats):
        for name in order[k % len(order):] + order[:k % len(order)]:
            waits.append(settle())
            if counted is None:
                times[name].append(peers[name]())
            else:
                seconds, links = counted(peers[name])
                times[name].append(seconds)
                wire[name].append(links)
                if counted.last_timeline:
                    idle[name].append(counted.last_timeline)
    return times, wire, idle, waits
