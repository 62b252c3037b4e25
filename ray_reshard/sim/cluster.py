"""Described clusters: GPUs per NVLink domain, link bandwidths, per-message and per-item costs.

Every GPU (every rank of either side) has its own NIC and NVLink port, each with one direction
for sends and one for receives. Training and inference ranks sit on different GPUs; rank r of
a side lives in domain r // gpus_per_domain of that side (the planner's domains say the same).
`fabric_Bps` / `domain_fabric_Bps` optionally cap the sum over all links (a machine where every
"GPU" shares the same CPUs, such as the local preset).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ..execution.program import PER_ITEM_MIN_BYTES

GB = 1e9

# Executor CPU time per item (one box of one tensor packed, unpacked or sent in place) and per
# local tensor per process (fitted: everything in a refit that grows with the local tensors;
# the check of each before the rounds is about 0.15 us of it, `bench-replay`'s check table),
# measured on the development machine by `python -m ray_reshard.tools.bench.sim_calibrate`
# (2-core CPU box, every tensor its own local tensor; host-side Python costs, which a GPU host
# pays too, on faster cores): the medians over the three runs of the benchmark page's
# calibration (2026-12-07, f5ab3e9).
MEASURED_ITEM_S = 0.745e-6
MEASURED_TENSOR_S = 1.80e-6
# A steady-state refit's check per shard: a copy of the view table (0.005-0.008 us per shard
# on the busiest DeepSeek-V3 ranks, `bench-replay`'s check table on the benchmark page; its
# signature per local tensor there, 0.15 us, is below MEASURED_TENSOR_S, which the GPU
# presets keep).
MEASURED_SHARD_S = 0.01e-6
# The executor's CPU time per item at real-model scale: the busiest DeepSeek-V3 ranks' compiled
# programs (about 50k items each) replayed by `python -m ray_reshard bench-replay` on the
# benchmark page (2026-12-07, f5ab3e9: 1.77 us per item on the busiest destination, 3.24 us on
# the busiest source, copying the scaled-down bytes on the CPU included; their mean): what the
# GPU presets charge per item copied one by one (gather-broadcast's tensors, and reshard
# buckets with `copy_tables` off).
REPLAY_ITEM_S = 2.5e-6
# On a GPU a reshard bucket end's regions are copied by one copy-table launch (see
# execution/cuda_copy.py), whatever their count: per bucket end, the executor's own time per
# step without its copies (5.9 us on the busiest DeepSeek-V3 destination, `bench-replay` on the
# benchmark page, column "steps w/o copies") plus that launch. LAUNCH_S is an estimate (cupy's Python launch
# path, a device switch and the stream lookup), not a measurement: `release_tests/gpu_smoke.py`
# measures it on a GPU host (step `copy_tables`).
MEASURED_STEP_S = 5.9e-6
LAUNCH_S = 20e-6
# A delta refit's codec (execution/delta.py), in bucket bytes per second at each end: the
# sender's compare against its baseline and encoding, the receiver's decoding and checksum.
# On a GPU an assumption (the codec's few torch ops over a bucket, each a pass over HBM), not
# a measurement; the local preset's are the 10%-changed row of `python -m ray_reshard
# bench-delta --codec` (the host codec on one CPU thread, 16 MiB bf16 buckets read from 8
# tensors, medians of 9), as one run on 2026-12-06 printed it.
ASSUMED_DELTA_ENCODE_BPS = 300e9
ASSUMED_DELTA_DECODE_BPS = 300e9
MEASURED_DELTA_ENCODE_BPS = 4.11e9
MEASURED_DELTA_DECODE_BPS = 5.97e9


@dataclass(frozen=True)
class Cluster:
    """Bandwidths in bytes per second per GPU and per direction; times in seconds."""

    name: str
    gpus_per_domain: int
    nvlink_Bps: float
    nic_Bps: float
    latency_s: float = 20e-6            # per network group a process posts
    ring_latency_s: float = 20e-6       # per ring transfer (its publish: the sender's sync or poll)
    item_s: float = MEASURED_ITEM_S
    tensor_s: float = MEASURED_TENSOR_S  # per local tensor per process taking part (fitted:
                                         # its check and all else that grows with the count;
                                         # a fused tensor holding many shards is one)
    shard_s: float = 0.0                # per shard per process (the view table)
    step_s: float = 0.0                 # per bucket end besides its items (the executor's step,
                                        # and the copy-table launch where `copy_tables`)
    copy_tables: bool = False           # a bucket end's regions are copied by one launch: no
                                        # cost per item (items still cost `item_s` elsewhere)
    fabric_Bps: Optional[float] = None
    domain_fabric_Bps: Optional[float] = None
    refit_overhead_s: float = 5e-3      # the driver's one call per process of a refit
    copy_Bps: float = 1000 * GB         # staging copies of strided regions, per rank
    contig_copy_Bps: float = 1000 * GB  # staging copies of contiguous regions, per rank
    message_s: float = 0.0              # CPU per message of an item sent as its own, per end
    per_item_min_bytes: Optional[int] = None  # CPU wire format: network items this large travel
                                              # as their own messages (None: buckets packed)
    cpu_cores: Optional[int] = None     # ranks share this many cores (None: each its own)
    broadcast: str = "ring"             # "ring": pipelined (NCCL); "flat": root sends each copy (gloo)
    pack_over_link: bool = False        # a ring sender packs straight into the receiver's slot
                                        # over the link (CUDA IPC): copy and transfer are one
    single_copy_rings: bool = False     # a ring receiver copies a contiguous sender's bytes
                                        # straight out of its memory (CPU, cross-memory
                                        # reads): the sender copies nothing
    ring_carry: bool = False            # a run of ring steps leaves receives not there yet
                                        # behind, taken once ready (NCCL: sliceable waits)
    ring_slots: int = 2                 # slots per ring (the executor's); a sender waits for
                                        # its receiver to free one (0: no limit, a what-if)
    host_overlap: bool = False          # the host issues a copy and goes on while the GPU runs
                                        # it (a ring slot published on its event): steps on the
                                        # host's clock, copies on the stream's
    delta_encode_Bps: float = ASSUMED_DELTA_ENCODE_BPS  # a delta refit's sender: bucket
                                        # bytes compared with the baseline and encoded per second
    delta_decode_Bps: float = ASSUMED_DELTA_DECODE_BPS  # its receiver: bucket bytes decoded
                                        # and checksummed per second

    def __post_init__(self):
        if self.gpus_per_domain < 1:
            raise ValueError(f"gpus_per_domain must be >= 1, got {self.gpus_per_domain}")
        for n in ("nvlink_Bps", "nic_Bps", "copy_Bps", "contig_copy_Bps", "delta_encode_Bps",
                  "delta_decode_Bps"):
            if not getattr(self, n) > 0:
                raise ValueError(f"{n} must be positive, got {getattr(self, n)}")
        if self.ring_slots < 0:
            raise ValueError(f"ring_slots must be >= 0, got {self.ring_slots}")
        for n in ("latency_s", "ring_latency_s", "item_s", "tensor_s", "shard_s", "step_s",
                  "refit_overhead_s", "message_s"):
            if getattr(self, n) < 0:
                raise ValueError(f"{n} must be >= 0, got {getattr(self, n)}")

    def with_(self, **changes) -> "Cluster":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def describe(self) -> str:
        s = (f"{self.name}: {self.gpus_per_domain} GPUs per NVLink domain, NVLink "
             f"{self.nvlink_Bps / GB:.0f} GB/s and NIC {self.nic_Bps / GB:.1f} GB/s "
             f"({self.nic_Bps * 8 / GB:.0f} Gb/s) per GPU per direction, "
             f"{self.latency_s * 1e6:.0f} us per network group, "
             f"{self.ring_latency_s * 1e6:.0f} us per ring transfer, ")
        if self.copy_tables:
            s += f"{self.step_s * 1e6:.1f} us per bucket end (one copy-table launch), "
        else:
            s += f"{self.item_s * 1e6:.1f} us per item, "
            if self.step_s:
                s += f"{self.step_s * 1e6:.1f} us per bucket end, "
        s += f"{self.tensor_s * 1e6:.1f} us per local tensor per process"
        if self.shard_s:
            s += f" and {self.shard_s * 1e6:.3f} us per shard"
        s += (f", {self.refit_overhead_s * 1e3:.1f} ms per refit, staging copies "
              f"{self.copy_Bps / GB:.1f} GB/s strided, {self.contig_copy_Bps / GB:.1f} GB/s "
              f"contiguous")
        if self.per_item_min_bytes is not None:
            s += (f", items of {self.per_item_min_bytes >> 10} KiB or more sent as their own "
                  f"messages ({self.message_s * 1e6:.1f} us each per end)")
        if self.pack_over_link:
            s += ", ring senders pack over the link"
        if self.single_copy_rings:
            s += ", ring receivers copy contiguous senders' bytes straight out of their memory"
        if self.host_overlap:
            s += ", host steps overlap the GPU's copies"
        if self.ring_carry:
            s += ", late ring receives left behind by their run"
        s += (f", {self.ring_slots} slots per ring" if self.ring_slots
              else ", ring slots without limit")
        if self.cpu_cores:
            s += f", all ranks on {self.cpu_cores} CPU cores"
        if self.fabric_Bps:
            s += f", all network links together {self.fabric_Bps / GB:.2f} GB/s"
        if self.domain_fabric_Bps:
            s += f", all domain links together {self.domain_fabric_Bps / GB:.2f} GB/s"
        return s


PRESETS = {
    # DGX H100: NVLink 4 (900 GB/s bidirectional per GPU), one 400 Gb/s ConnectX-7 per GPU.
    "dgx-h100": Cluster("dgx-h100", 8, 450 * GB, 400 / 8 * GB, latency_s=20e-6,
                        item_s=REPLAY_ITEM_S, step_s=MEASURED_STEP_S + LAUNCH_S,
                        shard_s=MEASURED_SHARD_S, copy_tables=True, pack_over_link=True,
                        host_overlap=True, ring_carry=True),
    # GB200 NVL72: 72 GPUs in one NVLink 5 domain (1.8 TB/s bidirectional per GPU), one
    # 400 Gb/s ConnectX-7 per GPU to the scale-out fabric.
    "gb200-nvl72": Cluster("gb200-nvl72", 72, 900 * GB, 400 / 8 * GB, latency_s=20e-6,
                           item_s=REPLAY_ITEM_S, step_s=MEASURED_STEP_S + LAUNCH_S,
                           shard_s=MEASURED_SHARD_S, copy_tables=True, pack_over_link=True,
                           host_overlap=True, ring_carry=True),
    # This machine's two simulated nodes (every rank shares 2 CPU cores): gloo over loopback as
    # the network, shared-memory rings as the domain links (their rate without the copies,
    # which are CPU work). To refresh the figures, run
    # `python -m ray_reshard.tools.bench.sim_calibrate --json FILE` and copy FILE's "constants"
    # (each fitted constant by its field name, the median over the three runs) and "settings"
    # (here: single-copy rings, items of 128 KiB and more as their own messages); the delta_*
    # rates come from bench-delta (see MEASURED_DELTA_ENCODE_BPS). These are the benchmark
    # page's calibration run (2026-12-07, commit f5ab3e9), rounded.
    "local": Cluster("local", 4, 14.07 * GB, 1.485 * GB, latency_s=383e-6,
                     ring_latency_s=352e-6, item_s=MEASURED_ITEM_S, tensor_s=MEASURED_TENSOR_S,
                     message_s=26.8e-6, fabric_Bps=2.58 * GB, domain_fabric_Bps=14.07 * GB,
                     refit_overhead_s=12.0e-3, copy_Bps=6.8 * GB, contig_copy_Bps=14.4 * GB,
                     cpu_cores=2, broadcast="flat",
                     per_item_min_bytes=PER_ITEM_MIN_BYTES, single_copy_rings=True,
                     delta_encode_Bps=MEASURED_DELTA_ENCODE_BPS,
                     delta_decode_Bps=MEASURED_DELTA_DECODE_BPS),
}


# The cluster in a box (`ray_reshard.tools.netns_cluster`): this machine's Ray nodes in network
# namespaces, each node's one link shaped by tc to a known rate each way. A node's 4 ranks
# share that link: each rank gets a quarter of it (exact where a plan spreads a node's network
# bytes over its 4 ranks, as reshard does for 4 ranks a node; the engine has no shared per-node
# link). Every other constant is the local preset's (the same machine, cores and rings); no
# fabric cap (the links are separate), and no constant is fitted to refits on the box.
BOX_RANKS_PER_NODE = 4


def shaped(rate_Bps: float, name: Optional[str] = None) -> Cluster:
    """The cluster in a box with every node's link at `rate_Bps` bytes per second each way."""
    if not rate_Bps > 0:
        raise ValueError(f"rate_Bps must be positive, got {rate_Bps}")
    return replace(PRESETS["local"], name=name or f"shaped-{rate_Bps * 8 / GB:g}gbit",
                   nic_Bps=rate_Bps / BOX_RANKS_PER_NODE, fabric_Bps=None)


PRESETS["shaped-1gbit"] = shaped(1 * GB / 8)
PRESETS["shaped-2gbit"] = shaped(2 * GB / 8)


def preset(name: str) -> Cluster:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown cluster {name!r}: expected one of {', '.join(PRESETS)}") from None


# Where each constant of a preset comes from: "datasheet" (the vendor's published figure),
# "measured here on CPU" (a benchmark of this project on its 2-core development machine) or
# "assumed" (an estimate no measurement backs). A constant given on the command line is
# "given". Not modelled at all: NCCL protocol efficiency, kernel launches other than the
# copy-table launch, CUDA IPC handle opening, HBM and PCIe contention.
DATASHEET, MEASURED_CPU, ASSUMED, GIVEN = "datasheet", "measured here on CPU", "assumed", "given"
NOT_MODELLED = ("NCCL protocol efficiency (links run at their datasheet rate)",
                "kernel launches other than one copy-table launch per bucket end",
                "CUDA IPC handle opening", "HBM and PCIe contention")
_GPU_COMMON = {
    "latency_s": (ASSUMED, "20 us per network group a process posts"),
    "ring_latency_s": (ASSUMED, "20 us per ring transfer (its publish)"),
    "item_s": (MEASURED_CPU, "bench-replay: busiest DeepSeek-V3 ranks' items (charged only "
                             "where regions are copied one by one)"),
    "tensor_s": (MEASURED_CPU, "sim_calibrate's fit: all a refit's per-process time that "
                               "grows with its local tensors (their check, about 0.15 us of "
                               "it, and the rest)"),
    "shard_s": (MEASURED_CPU, "bench-replay's check table: the view table per shard"),
    "step_s": (ASSUMED, "5.9 us executor step per bucket end (bench-replay, measured here on "
                        "CPU) + 20 us copy-table launch (assumed)"),
    "refit_overhead_s": (ASSUMED, "5 ms for the driver's call of every process"),
    "copy_Bps": (ASSUMED, "1000 GB/s staging copies of strided regions (HBM)"),
    "contig_copy_Bps": (ASSUMED, "1000 GB/s staging copies of contiguous regions (HBM)"),
}
PROVENANCE = {
    "dgx-h100": {
        "gpus_per_domain": (DATASHEET, "DGX H100: 8 GPUs per NVLink domain"),
        "nvlink_Bps": (DATASHEET, "NVLink 4: 900 GB/s per GPU both directions together"),
        "nic_Bps": (DATASHEET, "one 400 Gb/s ConnectX-7 per GPU"),
        **_GPU_COMMON},
    "gb200-nvl72": {
        "gpus_per_domain": (DATASHEET, "GB200 NVL72: 72 GPUs in one NVLink domain"),
        "nvlink_Bps": (DATASHEET, "NVLink 5: 1.8 TB/s per GPU both directions together"),
        "nic_Bps": (DATASHEET, "one 400 Gb/s ConnectX-7 per GPU"),
        **_GPU_COMMON},
    "local": {n: (MEASURED_CPU, "python -m ray_reshard.tools.bench.sim_calibrate")
              for n in ("gpus_per_domain", "nvlink_Bps", "nic_Bps", "latency_s",
                        "ring_latency_s", "item_s", "tensor_s", "message_s", "fabric_Bps",
                        "domain_fabric_Bps", "refit_overhead_s", "copy_Bps", "contig_copy_Bps",
                        "cpu_cores")},
}
_SHAPED = {n: (MEASURED_CPU, "the local preset's (python -m ray_reshard.tools.bench.sim_calibrate)")
           for n in ("gpus_per_domain", "nvlink_Bps", "latency_s", "ring_latency_s", "item_s",
                     "tensor_s", "message_s", "domain_fabric_Bps", "refit_overhead_s",
                     "copy_Bps", "contig_copy_Bps", "cpu_cores")}
for _rate in (1, 2):
    PROVENANCE[f"shaped-{_rate}gbit"] = {
        **_SHAPED, "nic_Bps": (GIVEN, f"the link's tc rate, {_rate} Gbit/s each way, shared by "
                                      f"a node's {BOX_RANKS_PER_NODE} ranks")}


_DELTA_GPU = {
    "delta_encode_Bps": (ASSUMED, "300 GB/s: the codec's compare and compaction, a few passes "
                                  "over HBM per bucket byte (not measured on a GPU)"),
    "delta_decode_Bps": (ASSUMED, "300 GB/s: the codec's decode and checksum, a few passes "
                                  "over HBM per bucket byte (not measured on a GPU)"),
}
# The constants only a delta refit's prediction charges (`sim.delta`).
DELTA_PROVENANCE = {
    "dgx-h100": _DELTA_GPU, "gb200-nvl72": _DELTA_GPU,
    "local": {n: (MEASURED_CPU, "python -m ray_reshard bench-delta: its codec line (one "
                                "thread, 10% changed; see docs/benchmarks.md)")
              for n in ("delta_encode_Bps", "delta_decode_Bps")},
}
for _rate in (1, 2):
    DELTA_PROVENANCE[f"shaped-{_rate}gbit"] = DELTA_PROVENANCE["local"]


def constants(cluster: Cluster, preset_name: str, given: tuple = (), delta: bool = False
              ) -> list:
    """Every numeric constant the simulator charges, with its value and provenance:
    [{"name", "value", "provenance", "source"}]. `given`: names set on the command line;
    `delta`: the constants of a delta refit's prediction instead."""
    prov = (DELTA_PROVENANCE if delta else PROVENANCE).get(preset_name, {})
    if delta:
        given = tuple(n for n in given if n in DELTA_PROVENANCE["local"])
    else:
        given = tuple(n for n in given if n not in DELTA_PROVENANCE["local"])
    out = []
    for name, (kind, source) in prov.items():
        value = getattr(cluster, name)
        if name in given:
            kind, source = GIVEN, "the command line"
        out.append({"name": name, "value": value, "provenance": kind, "source": source})
    for name in given:
        if name not in prov:
            out.append({"name": name, "value": getattr(cluster, name), "provenance": GIVEN,
                        "source": "the command line"})
    return out


def uncertain(consts: list, gpu: bool = True) -> list:
    """Names of the constants a sensitivity range varies: the assumed ones and, on a GPU
    cluster (`gpu`), those measured on this CPU too (they stand in for a GPU host's)."""
    kinds = (ASSUMED, MEASURED_CPU) if gpu else (ASSUMED,)
    return [c["name"] for c in consts if c["provenance"] in kinds
            and isinstance(c["value"], float) and c["value"] > 0]
