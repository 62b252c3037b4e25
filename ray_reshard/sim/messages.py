"""A plan's buckets as rows for the replay (`Messages`): the schedule's own (`messages_exact`), or
per-pair totals cut into buckets as the schedule cuts them (`messages_aggregate`), and the rows
put in run order. The order and the cuts are `ray_reshard.planning.schedule`'s (see its
docstring); nothing here times anything.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..planning.plan import DEFAULT_BUCKET_BYTES, Plan
from ..planning.moves import DOMAIN, LOCAL, NETWORK
from ..planning.schedule import (bucket_keys, forward_key, forward_segment, is_forward_key,
                                 parent_key)

PATH_CODE = {NETWORK: 0, DOMAIN: 1, LOCAL: 2}   # also the key's order of the paths
PATHS = {c: p for p, c in PATH_CODE.items()}
FORWARD_ORDER = 3                                # a forwarded bucket's `order` below


@dataclass
class Messages:
    """One row per bucket, in the schedule's global order.

    `order` is 0 network, 1 domain, 2 local, 3 forwarded; `parent` is
    the row of the network bucket a forwarded one passes on (-1: none, or unknown in the
    aggregate replay). Copied bytes per end: `strided_*` out of or into a strided region of the
    local shard, `contig_*` a contiguous one; the rest of a bucket's bytes move in place when
    `per_item` (a network bucket whose items all travel as their own messages on CPU).
    `per_item_min_bytes` is the threshold these rows were built with (see `messages_exact`);
    `replay` takes them only on a cluster with the same one.
    """

    round: np.ndarray
    order: np.ndarray
    sender: np.ndarray
    receiver: np.ndarray
    path: np.ndarray
    nbytes: np.ndarray
    items: np.ndarray
    strided_send: np.ndarray
    strided_recv: np.ndarray
    contig_send: np.ndarray
    contig_recv: np.ndarray
    per_item: np.ndarray
    parent: np.ndarray
    mode: str
    slot: Optional[np.ndarray] = None   # the key's position in its round (groups, forwards)
    itemsize: Optional[np.ndarray] = None   # the smallest element size of a bucket's items
    # A delta refit's buckets (`sim.delta.delta_messages`): bytes each sender compares against
    # its baseline and each receiver decodes or checksums; their copies are then final, and
    # `nbytes` is the payload.
    encode_bytes: Optional[np.ndarray] = None
    decode_bytes: Optional[np.ndarray] = None
    per_item_min_bytes: Optional[int] = None


class _Staging:
    """What each end of an item copies where its bucket is packed: from/to a strided or a
    contiguous region of its local shard. In a bucket whose items travel as their own messages
    the contiguous ends copy nothing (see `_in_place`)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.boxes: dict = {}

    def _holder(self, ti: int, side: str, rank: int):
        spec = self.plan.specs[ti]
        lay = spec.src if side == "src" else spec.dst
        key = (id(lay), spec.shape, rank)
        b = self.boxes.get(key)
        if b is None:
            b = self.boxes[key] = lay.box(rank, spec.shape)
        return b

    @staticmethod
    def _contiguous(box, holder) -> bool:
        if holder is None:
            return False
        sizes, full = box.sizes, holder.sizes
        for i, n in enumerate(sizes):
            if n > 1:
                return all(sizes[j] == full[j] for j in range(i + 1, len(sizes)))
        return True

    def __call__(self, ti: int, box, nbytes: int, src_side: str, src_rank: int,
                 dst_rank: int) -> tuple[int, int, int, int]:
        """(strided sent, contiguous sent, strided received, contiguous received) bytes copied."""
        cs = self._contiguous(box, self._holder(ti, src_side, src_rank))
        cr = self._contiguous(box, self._holder(ti, "dst", dst_rank))
        return (0 if cs else nbytes, nbytes if cs else 0, 0 if cr else nbytes,
                nbytes if cr else 0)


def _in_place(code: int, smallest: int, min_bytes: Optional[int]) -> bool:
    """Whether a bucket's items travel as their own messages, each contiguous end sending from
    or receiving into its region in place (the executor's `per_item`): a network bucket whose
    smallest item has at least `min_bytes` (None: never)."""
    return code == PATH_CODE[NETWORK] and min_bytes is not None and smallest >= min_bytes


def sources_and_world(plan: Plan) -> tuple[int, int]:
    """(source ranks, all ranks): a GPU's index is its source rank, or n_src + its
    destination rank."""
    n_src = plan.topology.n_src
    return n_src, n_src + plan.topology.n_dst


def _check_threshold(per_item_min_bytes) -> None:
    if per_item_min_bytes is not None and (isinstance(per_item_min_bytes, bool)
                                           or not isinstance(per_item_min_bytes, int)
                                           or per_item_min_bytes < 1):
        raise ValueError(f"per_item_min_bytes must be a positive int or None (every bucket "
                         f"packed), got {per_item_min_bytes!r}")


def messages_exact(plan: Plan, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   per_item_min_bytes: Optional[int] = None) -> Messages:
    """The schedule's buckets, as the executor runs them on a cluster whose network items of
    at least `per_item_min_bytes` travel as their own messages (`Cluster.per_item_min_bytes`;
    None: every bucket packed, as on GPUs)."""
    _check_threshold(per_item_min_bytes)
    n_src, _ = sources_and_world(plan)
    ts = plan.schedule(bucket_bytes).transfers
    n = len(ts)
    cols = [np.empty(n, dtype=np.int64) for _ in range(12)]
    rnd, order, snd, rcv, pth, nb, it, ss, sr, cs, cr, parent = cols
    slot = np.empty(n, dtype=np.int64)
    per_item = np.zeros(n, dtype=bool)
    staging = _Staging(plan)
    isz = [spec.itemsize for spec in plan.specs]
    row_of: dict = {}
    itemsize = np.empty(n, dtype=np.int64)
    for i, t in enumerate(ts):
        rnd[i], slot[i] = t.key[0], t.key[2]
        order[i] = FORWARD_ORDER if t.src.side == "dst" else t.key[1]
        snd[i] = t.src.rank if t.src.side == "src" else n_src + t.src.rank
        rcv[i] = n_src + t.dst
        pth[i] = code = PATH_CODE[t.path]
        nb[i] = t.nbytes
        it[i] = len(t.items)
        acc = [0, 0, 0, 0]
        smallest = 1 << 62
        itemsize[i] = min(isz[item.tensor] for item in t.items)
        for item in t.items:
            nbytes = item.box.numel * isz[item.tensor]
            smallest = min(smallest, nbytes)
            for j, v in enumerate(staging(item.tensor, item.box, nbytes, t.src.side,
                                          t.src.rank, t.dst)):
                acc[j] += v
        per_item[i] = _in_place(code, smallest, per_item_min_bytes)
        if per_item[i]:
            acc[1] = acc[3] = 0
        ss[i], cs[i], sr[i], cr[i] = acc
        if code == 0:
            row_of[t.key] = i
        parent[i] = row_of.get(parent_key(t), -1) if order[i] == FORWARD_ORDER else -1
    return Messages(rnd, order, snd, rcv, pth, nb, it, ss, sr, cs, cr, per_item, parent, "exact",
                    slot, itemsize, per_item_min_bytes=per_item_min_bytes)


def _share_of(total: int, n: int, k: int) -> int:
    """Bytes of bucket k of a pair whose `total` bytes the schedule cuts into n about equal
    buckets (`schedule.bucket_starts`)."""
    return total * (k + 1) // n - total * k // n


def _pair_totals(plan: Plan, n_src: int) -> dict:
    """Per (sender, receiver, path, parent) - parent: for a forwarded piece the source whose
    network bucket brought it in, else -1 - bytes, items, strided sent, contiguous sent,
    strided received, contiguous received, smallest move, smallest itemsize."""
    staging = _Staging(plan)
    pairs: dict[tuple, list] = defaultdict(lambda: [0, 0, 0, 0, 0, 0, 1 << 62, 1 << 62])
    for tp, count, ti in plan.distinct_plans:
        isz = tp.itemsize
        per = defaultdict(lambda: [0, 0, 0, 0, 0, 0, 1 << 62, isz])
        brought_by = {(m.dst, m.box): m.src.rank for m in tp.moves
                      if m.path == NETWORK and m.src.side == "src"}
        for m in tp.moves:
            forwarded = m.src.side == "dst"
            s = n_src + m.src.rank if forwarded else m.src.rank
            parent = brought_by.get((m.src.rank, m.box), -1) if forwarded else -1
            code = PATH_CODE[m.path]
            e = per[(s, n_src + m.dst, code, parent)]
            nbytes = m.box.numel * isz
            a = staging(ti, m.box, nbytes, m.src.side, m.src.rank, m.dst)
            e[0] += nbytes
            e[1] += 1
            e[2] += a[0]
            e[3] += a[1]
            e[4] += a[2]
            e[5] += a[3]
            e[6] = min(e[6], nbytes)
        for k, v in per.items():
            e = pairs[k]
            for j in range(6):
                e[j] += count * v[j]
            e[6] = min(e[6], v[6])
            e[7] = min(e[7], v[7])
    return pairs


def messages_aggregate(plan: Plan, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                       per_item_min_bytes: Optional[int] = None) -> Messages:
    """Per (sender, receiver, path) byte and item totals cut into buckets of at most
    bucket_bytes, in the schedule's key order: a network pair's bytes in as many about equal
    buckets as the schedule cuts (others ceil(total / bucket_bytes)), its k-th at its k-th turn
    (`Plan.network_turns`; others in round k); what a forwarder passes on to one target out of
    a segment of a round (each network pair's forwarded bytes placed in that pair's turns)
    merged and cut into buckets placed as `schedule.forward_key` places them. `per_item_min_bytes`:
    as in `messages_exact`."""
    _check_threshold(per_item_min_bytes)
    n_src, world = sources_and_world(plan)
    n_dst = world - n_src
    pairs = _pair_totals(plan, n_src)
    rows = []   # (key, sender, receiver, path, bytes, items, 4 copied counts, per item, itemsize)
    turns = plan.network_turns(bucket_bytes)      # the schedule's, so its bucket counts too
    net_of = {}
    for (snd, rcv, code, parent), v in pairs.items():
        if parent < 0:
            n = (len(turns[(snd, rcv - n_src)]) if code == PATH_CODE[NETWORK] and turns
                 else max(1, -(-v[0] // bucket_bytes)))
            net_of[(snd, rcv)] = (n, v[0])
    # what each forwarder passes to each target per round: (f, t, path, k) -> totals
    fwd: dict[tuple, list] = defaultdict(lambda: [0.0] * 6 + [1 << 62])
    for (snd, rcv, code, parent), v in pairs.items():
        if parent >= 0:
            # The pieces a target takes from a network pair fill about their share of that
            # pair's buckets (all of them where it takes everything the pair brings): spread
            # them over that many of the pair's rounds, staggered by target, in proportion to
            # the bytes the pair brings in each.
            nbk, pair_bytes = net_of.get((parent, snd), (1, v[0]))
            m = max(1, min(nbk, -(-v[0] * nbk // max(1, pair_bytes))))
            ks = [(parent + rcv + i * nbk // m) % nbk for i in range(m)]
            sizes = [_share_of(pair_bytes, nbk, k) for k in ks]
            whole = sum(sizes) or 1
            keys = bucket_keys(nbk, parent, parent, snd - n_src, NETWORK,
                               turns if (parent, snd) in net_of else None, n_src, n_dst)
            for k, size in zip(ks, sizes):
                e = fwd[(snd, rcv, code, keys[k][0], forward_segment(keys[k][2], n_src, n_dst))]
                for j in range(6):
                    e[j] += v[j] * size / whole
                e[6] = min(e[6], v[7])
            continue
        n = net_of[(snd, rcv)][0]
        tot, items = v[0], v[1]
        keys = bucket_keys(n, snd, snd, rcv - n_src, PATHS[code], turns, n_src, n_dst)
        for k in range(n):
            nb = _share_of(tot, n, k)
            share = nb / max(1, tot)
            it = max(1, items // n + (k < items % n))
            # all of a pair's buckets travel per item where its smallest move reaches the
            # threshold, else all are packed (the schedule's own buckets may differ)
            packed = not _in_place(code, v[6], per_item_min_bytes)
            rows.append((keys[k], snd, rcv, code, nb, it, int(v[2] * share),
                         int(v[3] * share) if packed else 0, int(v[4] * share),
                         int(v[5] * share) if packed else 0, not packed, v[7]))
    for (f, t, code, k, seg), v in fwd.items():
        tot = int(round(v[0]))
        n = max(1, -(-tot // bucket_bytes))
        for c in range(n):
            nb = bucket_bytes if c < n - 1 else tot - (n - 1) * bucket_bytes
            share = nb / max(1, tot)
            it = max(1, int(round(v[1] / n)))
            key = forward_key(k, seg, f - n_src, t - n_src, PATHS[code], c, (k, 0, 0, 0), n_src,
                              n_dst)
            rows.append((key, f, t, code, nb, it, *(int(v[j] * share) for j in (2, 3, 4, 5)),
                         False, v[6]))
    rows.sort(key=lambda r: r[0])
    n = len(rows)
    col = lambda j, dt=np.int64: np.fromiter((r[j] for r in rows), dtype=dt, count=n)
    keys = [r[0] for r in rows]
    fwd_row = np.fromiter(map(is_forward_key, keys), dtype=bool, count=n)
    path = col(3)
    return Messages(np.fromiter((k[0] for k in keys), dtype=np.int64, count=n),
                    np.where(fwd_row, FORWARD_ORDER, path), col(1), col(2), path, col(4),
                    col(5), col(6), col(8), col(7), col(9), col(10, bool),
                    np.full(n, -1, dtype=np.int64), "aggregate",
                    np.fromiter((k[2] for k in keys), dtype=np.int64, count=n), col(11),
                    per_item_min_bytes=per_item_min_bytes)


def in_run_order(msgs: Messages, span: int) -> Messages:
    """The rows in the order processes run them with network groups of `span` positions
    (`schedule.run_order`)."""
    if span <= 1 or msgs.slot is None or not len(msgs.round):
        return msgs
    fwd = msgs.order == FORWARD_ORDER
    first = np.where(fwd, 0, msgs.order)
    block = np.where(first == 0, msgs.slot // span, 0)
    o = np.lexsort((np.arange(len(fwd)), fwd & (first == 0), block, first, msgs.round))
    if np.array_equal(o, np.arange(len(o))):
        return msgs
    inv = np.empty_like(o)
    inv[o] = np.arange(len(o))
    par = msgs.parent[o]
    cols = {f: getattr(msgs, f)[o] for f in ("round", "order", "sender", "receiver", "path",
                                             "nbytes", "items", "strided_send", "strided_recv",
                                             "contig_send", "contig_recv", "per_item", "slot")}
    cols.update({f: getattr(msgs, f)[o] for f in ("itemsize", "encode_bytes", "decode_bytes")
                 if getattr(msgs, f) is not None})
    return Messages(parent=np.where(par >= 0, inv[np.maximum(par, 0)], -1), mode=msgs.mode,
                    per_item_min_bytes=msgs.per_item_min_bytes, **cols)
