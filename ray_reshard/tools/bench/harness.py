"""What every comparing benchmark shares: a local cluster whose object store fits the payload,
a check that nothing spilled, a quiet machine before each timed run, and medians with their
spread.

A baseline runs at its best or the comparison says nothing: Ray's test clusters give each node
150 MiB of object store unless told otherwise, and a 256 MiB payload then spills to disk. The
cluster here sizes each node's store for the payload, and `SpillCheck` reads Ray's own spill
counters before and after the timed runs: a run that spilled fails instead of printing figures.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass

MiB = 1 << 20
MIN_STORE_BYTES = 512 * MiB

# Student's t, two-sided 95%: its 0.975 quantile for 1..10 degrees of freedom (beyond, the
# Cornish-Fisher expansion in `_t975` is within 0.01 of it).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def _t975(df: int) -> float:
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def predicted_range(values) -> tuple[float, float]:
    """Where a further value of `values`' kind falls with 95% chance, were they independent
    draws of one normal distribution: mean +- t * sd * sqrt(1 + 1/n) (Student's t, n - 1
    degrees of freedom). Needs two values or more; wide for few (x 4.97 sd for 3)."""
    n = len(values)
    if n < 2:
        raise ValueError(f"a prediction needs 2 values or more, got {n}")
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    half = _t975(n - 1) * sd * (1 + 1 / n) ** 0.5
    return mean - half, mean + half


@dataclass
class Spread:
    """Median and range of repeated timings, in seconds."""

    values: list

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    def text(self, unit: float = 1.0, digits: int = 3) -> str:
        """'median [low-high]' in `unit`s."""
        f = f"{{:.{digits}f}}"
        return (f"{f.format(self.median / unit)} [{f.format(self.low / unit)}-"
                f"{f.format(self.high / unit)}]")

    def as_dict(self) -> dict:
        return {"median": self.median, "low": self.low, "high": self.high,
                "values": list(self.values)}

    def judged(self, met) -> dict:
        """A goal's figures over runs: judged on the median (`met(value)`), with the lowest and
        highest run and in how many runs it was met."""
        return {"measured": self.median, "met": met(self.median), "low": self.low,
                "high": self.high, "runs": len(self.values),
                "runs_met": sum(bool(met(v)) for v in self.values), "values": list(self.values)}


def store_bytes_for(payload_bytes: int) -> int:
    """Object store per node for a payload: every byte primary on the sending node and once
    fetched on the receiving one, twice over (one refit's objects may live on while the next
    is created), and never under 512 MiB."""
    return max(MIN_STORE_BYTES, 4 * payload_bytes + 256 * MiB)


def store_capacity() -> dict:
    """Object store bytes of each node of the connected cluster, by its "node<i>" resource."""
    import ray

    out = {}
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        for key in res:
            if key.startswith("node") and key[4:].isdigit():
                out[key] = int(res.get("object_store_memory", 0))
    return out


def check_store(need_bytes: int) -> dict:
    """Fail unless every node's object store holds `need_bytes`; returns the capacities."""
    cap = store_capacity()
    small = {k: v for k, v in cap.items() if v < need_bytes}
    if small:
        raise RuntimeError(
            f"object store too small for a fair baseline: need {need_bytes / MiB:.0f} MiB per "
            f"node, have " + ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in sorted(small.items()))
            + " (start the cluster with a larger object_store_memory)")
    return cap


def spilled_bytes(address: str) -> tuple[int, int]:
    """(spilled, restored) bytes over the whole cluster since it started, from the raylets'
    object store statistics (what `ray memory --stats-only` prints)."""
    from ray._private import internal_api    # Ray's own reader of the raylets' store stats

    reply = internal_api.get_memory_info_reply(internal_api.get_state_from_address(address))
    return int(reply.store_stats.spilled_bytes_total), int(reply.store_stats.restored_bytes_total)


class SpillCheck:
    """Reads the cluster's spill counters at creation; `check()` fails if they grew since."""

    def __init__(self, address: str):
        self.address = address
        self.start = spilled_bytes(address)

    def check(self, what: str) -> dict:
        now = spilled_bytes(self.address)
        spilled, restored = now[0] - self.start[0], now[1] - self.start[1]
        if spilled or restored:
            raise RuntimeError(
                f"{what}: the object store spilled {spilled / MiB:.1f} MiB and restored "
                f"{restored / MiB:.1f} MiB during the timed runs, so the object-store figures "
                f"would measure the disk; rerun with a larger --store-mb")
        return {"spilled_bytes": spilled, "restored_bytes": restored}


SETTLE_LIMIT_S = 3.0          # the longest wait for a quiet machine before a timed run


def settle(quiet: float = 0.25, window_s: float = 0.05,
           limit_s: float = SETTLE_LIMIT_S) -> float:
    """Wait until the machine is quiet: the share of all CPUs busy over `window_s` below
    `quiet`, or `limit_s` passed. Work one timed run leaves behind (the object store freeing
    a refit's objects, a collective's threads winding down) then ends before the next run
    starts instead of landing on whichever method runs next. Returns the seconds waited."""
    import psutil

    t0 = time.perf_counter()
    while psutil.cpu_percent(interval=window_s) >= 100 * quiet:
        if time.perf_counter() - t0 >= limit_s:
            break
    return time.perf_counter() - t0


def machine_facts() -> dict:
    """What a reader needs to place the figures: CPU, cores, memory, versions, date."""
    import ray
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu,
            "cores": os.cpu_count(), "memory_gib": round(mem / (1 << 30), 1),
            "python": platform.python_version(), "ray": ray.__version__,
            "torch": torch.__version__, "load_avg_1m": round(os.getloadavg()[0], 2)}


def raw_bandwidth(group, nbytes_per_pair: int, pairs=None) -> float:
    """Aggregate GB/s of plain sends over `group`'s network transport, between its own
    processes (the same actors and collective group a refit uses).

    By default source i sends `nbytes_per_pair` to destination i (all pairs at once); `pairs`:
    (sender process, receiver process) pairs instead."""
    import ray

    from ...planning.moves import Endpoint
    from ...runtime import worker
    from ...runtime.protocol import default_timeout_s

    procs, proc_of = group.members.procs, group.members.proc_of
    if pairs is None:
        pairs = [(proc_of[Endpoint("src", i)], proc_of[Endpoint("dst", i)])
                 for i in range(min(len(group.src_actors), len(group.dst_actors)))]
        pairs = [(s, d) for s, d in pairs if s != d]
    sends: dict = {}
    recvs: dict = {}
    for s, d in pairs:
        sends.setdefault(s, {})[d] = 1
        recvs.setdefault(d, {})[s] = 1
    pids = sorted(set(sends) | set(recvs))
    timeout = default_timeout_s(nbytes_per_pair * len(pairs))
    secs = ray.get([procs[p].__ray_call__.remote(
        worker.raw_transfer, group.group_id, sends.get(p, {}), recvs.get(p, {}),
        nbytes_per_pair, timeout) for p in pids])
    return nbytes_per_pair * len(pairs) / max(secs) / 1e9
