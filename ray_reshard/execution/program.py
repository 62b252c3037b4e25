"""Compiled per-process programs: one process's share of a refit as flat, precomputed steps.

`compile_program(plan, endpoints, ...)` turns the transfers a process takes part in (see
`build_share`: every process derives them, in the shared global order, from the plan alone)
into `Step`s. Each step holds, for the side(s) this process runs, a `Part`: per item the local
shard it lives in (an index into `Program.held`), the slices of the item inside that shard,
its shape, element count and wire dtype. Nothing in a step refers to the plan any more.

Wire format (the same in the simulator and the runtime): a bucket's bytes are its items back
to back in the transfer's item order, each item row-major in the destination dtype (items are
sorted by element size, largest first, so every item starts aligned to its element size). A
network bucket whose items are all at least `PER_ITEM_MIN_BYTES` travels as one message per
item (the same bytes cut at item boundaries), so each end can send from or receive into its
own contiguous tensor regions in place; any other bucket travels as one message.

A `Part` (part.py) is bound to the process's shard views at run time and packs and unpacks its
items.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch

from . import fp8 as _fp8
from . import host_copy
from .part import UNALIGNED, Part
from .._gc import gc_paused
from ..planning.plan import Plan
from ..planning.schedule import Transfer, parent_key, run_order
from ..planning.share import build_share
from ..planning.moves import NETWORK, Endpoint

SEND, RECV, COPY = "send", "recv", "copy"

# Network buckets whose items are all at least this large travel as one message per item, on
# CPU tensors (a message costs less than copying such an item into a staging buffer and out of
# one). Over gloo on a loaded host, 64 KiB items moved faster packed and 128 KiB items as their
# own messages (`python -m ray_reshard bench-peers --counts 512,1024` moves both sizes through
# the executor; comparing the two formats means running it with this threshold changed). On
# GPUs a device copy costs far less than a message, so buckets always travel packed (threshold
# None).
PER_ITEM_MIN_BYTES = 128 << 10


def per_item_min_bytes(device_type: str):
    """The per-item threshold for a group's device type (the same on both ends of a group)."""
    return PER_ITEM_MIN_BYTES if device_type == "cpu" else None


def per_item(plan: Plan, t: Transfer, min_bytes: Optional[int] = PER_ITEM_MIN_BYTES) -> bool:
    """Wire format of a network bucket, decided from the plan alone so both ends agree:
    True = one message per item, False = one packed message for the whole bucket."""
    return min_bytes is not None and t.path == NETWORK and all(
        it.box.numel * plan.specs[it.tensor].itemsize >= min_bytes for it in t.items)


@dataclass
class Step:
    """One transfer as this process runs it."""

    kind: str                     # SEND, RECV or COPY (both ends here)
    key: tuple                    # global order key
    path: str
    peer: int                     # the other process (-1 for COPY)
    nbytes: int
    per_item: bool                # network: one message per item
    after: Optional[tuple]        # sending a forward: key of the network bucket that brought it
    send: Optional[Part] = None   # the packing side (SEND, COPY)
    recv: Optional[Part] = None   # the unpacking side (RECV, COPY)
    # Whether a receiver's packed regions are the bytes it received (no item lands in a
    # buffer quantised later, see fp8.Finisher): a delta refit may send it as a delta.
    delta_ok: bool = True


@dataclass
class Program:
    """One process's compiled share of a refit plan."""

    held: list                    # (side, rank, tensor index) of every local shard used
    steps: list
    bucket_bytes: int
    max_ring_bytes: dict = field(default_factory=dict)   # peer -> largest non-network bucket sent
    staging: Any = None           # the executor's staging buffers (kept across refits)
    _sigs: Optional[list] = None
    _users: Optional[list] = None  # per held index: the parts reading or writing that shard
    _token: Any = None             # the caller's name for the views bound last (see bind)
    finishers: list = field(default_factory=list)   # see fp8.Finisher
    _orders: dict = field(default_factory=dict)      # span -> steps in `run_order`
    round_len: int = 0            # positions in a round of the schedule (see plan.group_span)

    def ordered(self, span: int) -> list:
        """The steps in the order they run with network groups of `span` rotations
        (`plan.run_order`: the key order, forwards inside a group's rotations after it)."""
        if span <= 1:
            return self.steps
        got = self._orders.get(span)
        if got is None:
            got = self._orders[span] = sorted(self.steps, key=lambda st: run_order(st.key, span))
        return got

    @property
    def n_items(self) -> int:
        return sum(len(p) for s in self.steps for p in (s.send, s.recv) if p is not None)

    def parts(self):
        for s in self.steps:
            if s.send is not None:
                yield s.send
            if s.recv is not None:
                yield s.recv

    def bind(self, lookup, token: Any = None, engine: Any = "auto") -> int:
        """Bind every part to the shard views `lookup[(side, rank, tensor)]`; only the parts
        whose shards changed storage, shape, strides or dtype since the last bind are rebuilt.
        `token`: the caller's name for exactly these view objects (None: unnamed); binding
        the views bound last under the same token checks nothing (finishers still start a new
        refit). `engine` copies each part's regions as one copy table (see `regions`):
        "auto" is one launch per table on CUDA (`cuda_copy`, where cupy is installed), one
        pass of memmoves over the contiguous regions in host memory (`host_copy`), foreach
        copies for the rest; None is always foreach. Returns how many parts were (re)built."""
        views = None
        if self.finishers:
            views = [lookup.get(k) for k in self.held]
            for f in self.finishers:
                f.bind(views)
        if token is not None and token == self._token and self._sigs is not None:
            return 0
        self._token = token
        if views is None:
            views = [lookup[k] for k in self.held]
        # Shapes, dtypes and devices are validated before every refit: where the view starts
        # and how it is laid out tell whether the regions cut from it still hold.
        sigs = [(v.data_ptr(), v.stride()) for v in views]
        if self._users is None:
            self._users = [[] for _ in self.held]
            for p in self.parts():
                for h in p.holds():
                    self._users[h].append(p)
        if self._sigs is None:
            dirty = list(self.parts())
        else:
            seen, dirty = set(), []
            for h, (old, new) in enumerate(zip(self._sigs, sigs)):
                if old != new:
                    for p in self._users[h]:
                        if id(p) not in seen:
                            seen.add(id(p))
                            dirty.append(p)
        if engine == "auto":
            engine = _auto_engine(views)
        for p in dirty:
            p.bind(views, engine)
        tables = [p.table for p in dirty if p.table is not None]
        changed = {id(p) for p in dirty}
        for st in self.steps:
            if st.kind == COPY and (id(st.send) in changed or id(st.recv) in changed):
                table = st.recv.pair_with(st.send, engine)
                if table is not None:
                    tables.append(table)
        if tables:
            device = next(v.device for v in views if v is not None)
            engine.upload(tables, device)       # one transfer for all of them
        self._sigs = sigs
        return len(dirty)

    def unbind(self) -> None:
        """Drop every bound view (a later bind rebuilds them)."""
        for p in self.parts():
            p.unbind()
        self._sigs = None


def _auto_engine(views: Sequence[torch.Tensor]):
    """The CUDA copy engine when the views are on a GPU (None where it cannot run), the host
    one when they are in host memory."""
    first = next((v for v in views if v is not None), None)
    if first is None:
        return None
    if first.device.type == "cpu":
        return host_copy.engine()
    if not first.is_cuda:
        return None
    from . import cuda_copy
    return cuda_copy.engine()


def _part(plan: Plan, t: Transfer, side: str, rank: int, held_index: dict, held: list,
          info: dict, finishers: list, geometry: dict) -> Part:
    """`t`'s items on one side. `geometry` caches (slices, sizes, numel) per (box object, shard
    origin) for one compile: a share reuses a few dozen boxes across tens of thousands of items
    (the planner shares the pieces of like tensors), and the transfers keep them alive."""
    hs, sl, shapes, numels, wire, offs, nbs = [], [], [], [], [], [], []
    quant = None
    off = 0
    got_side = info.get((side, rank))
    if got_side is None:
        got_side = info[(side, rank)] = ({}, {})
    shard_info, origins = got_side
    for it in t.items:
        ti = it.tensor
        got = shard_info.get(ti)
        if got is None:
            k = (side, rank, ti)
            spec = plan.specs[ti]
            h = held_index[k] = len(held)
            held.append(k)
            ctx = None
            if spec.quant is not None:
                ctx = _fp8.ItemContext(spec, side, rank, ti)
                if ctx.scale_key is not None:
                    held_index[ctx.scale_key] = ctx.scale_held = len(held)
                    held.append(ctx.scale_key)
                f = ctx.finisher
                if f is not None:         # items land in its buffer: a held key of its own
                    f.held[0] = h
                    for j in (1, 2):
                        f.held[j] = held_index[f.keys[j]] = len(held)
                        held.append(f.keys[j])
                    h = f.held[2]
                    finishers.append(f)
            lay = spec.layout(side)
            origin = origins.get((id(lay), spec.shape))
            if origin is None:
                origin = origins[(id(lay), spec.shape)] = lay.box(rank, spec.shape).offsets
            got = shard_info[ti] = (h, origin, spec.dtype if ctx is None else ctx.wire_dtype,
                                    plan.tensor_plans[ti].itemsize, ctx)   # = spec.itemsize
        h, origin, dtype, size, ctx = got
        box = it.box
        if ctx is not None:
            if quant is None:
                quant = [None] * len(hs)
            qi, box = ctx.item(box)
            quant.append(qi)
        elif quant is not None:
            quant.append(UNALIGNED if off % size else None)
        geo = geometry.get((id(box), id(origin))) if ctx is None else None
        if geo is None:
            sizes = box.sizes
            n = 1
            for x in sizes:
                n *= x
            geo = (tuple([slice(a - o, a - o + m) for a, o, m in zip(box.offsets, origin, sizes)]),
                   sizes, n)
            if ctx is None:
                geometry[(id(box), id(origin))] = geo
        hs.append(h)
        sl.append(geo[0])
        shapes.append(geo[1])
        n = geo[2]
        numels.append(n)
        wire.append(dtype)
        offs.append(off)
        nb = n * size if ctx is None else it.box.numel * size
        nbs.append(nb)
        off += nb
    return Part(hs, sl, shapes, numels, wire, offs, nbs, off,
                None if quant is None or all(q is None for q in quant) else quant)


def compile_program(plan: Plan, endpoints: Iterable[Endpoint], bucket_bytes: int,
                    proc_of: Optional[dict] = None,
                    transfers: Optional[Sequence[Transfer]] = None,
                    per_item_bytes: Optional[int] = PER_ITEM_MIN_BYTES) -> Program:
    """Compile the share of `plan` that the process holding `endpoints` runs.

    `proc_of` maps every endpoint to its process (default: each endpoint its own process,
    numbered sources first). `transfers` may pass the share when the caller has it already.
    `per_item_bytes` is the wire format's per-item threshold (see `per_item_min_bytes`); every
    process of a group must use the same.
    """
    mine = frozenset(endpoints)
    if proc_of is None:
        n_src = plan.topology.n_src
        proc_of = _Procs(n_src)
    if transfers is None:
        transfers = build_share(plan, mine, bucket_bytes)
    with gc_paused(keep=True):   # one object per item and slice, all acyclic, kept
        return _compile(plan, mine, bucket_bytes, proc_of, transfers, per_item_bytes)


def _compile(plan, mine, bucket_bytes, proc_of, transfers, per_item_bytes) -> Program:
    held: list = []
    held_index: dict = {}
    # (side, rank) -> ({tensor: (held index, shard origin, dtype, itemsize, quant context)},
    #                  {(layout id, shape): shard origin})
    info: dict = {}
    finishers: list = []         # block-FP8 shards quantised here once received (fp8.Finisher)
    geometry: dict = {}          # see _part
    steps = []
    ring: dict = {}
    # Tensors whose destinations quantise what they receive (see fp8.Finisher).
    widened = {i for i, spec in enumerate(plan.specs)
               if spec.quant is not None and not spec.on_block_grid}
    for t in transfers:
        dst_ep = Endpoint("dst", t.dst)
        here_send, here_recv = t.src in mine, dst_ep in mine
        after = parent_key(t) if (here_send and t.src.side == "dst") else None
        send = (_part(plan, t, t.src.side, t.src.rank, held_index, held, info, finishers,
                      geometry) if here_send else None)
        recv = (_part(plan, t, "dst", t.dst, held_index, held, info, finishers, geometry)
                if here_recv else None)
        if here_send and here_recv:
            kind, peer = COPY, -1
        elif here_send:
            kind, peer = SEND, proc_of[dst_ep]
            if t.path != NETWORK:
                ring[peer] = max(ring.get(peer, 0), t.nbytes)
        else:
            kind, peer = RECV, proc_of[t.src]
        part = send if send is not None else recv
        whole = (per_item_bytes is not None and t.path == NETWORK
                 and min(part.item_bytes) >= per_item_bytes)
        exact = not widened or not any(it.tensor in widened for it in t.items)
        steps.append(Step(kind, t.key, t.path, peer, t.nbytes, whole, after, send, recv, exact))
    return Program(held, steps, bucket_bytes, ring, finishers=finishers,
                   round_len=max(plan.topology.n_src, plan.topology.n_dst))


class _Procs:
    """Default process numbering: source rank r is process r, destination rank r is n_src + r."""

    def __init__(self, n_src: int):
        self.n_src = n_src

    def __getitem__(self, ep: Endpoint) -> int:
        return ep.rank if ep.side == "src" else self.n_src + ep.rank
