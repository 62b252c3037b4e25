"""The schedule: every bucket of a plan in one global order that every process derives alike
(the ordering contract the executor runs and the simulator replays).

A bucket (`Transfer`) goes from one sender to one receiver over one path; its `key` orders it.
Network buckets of a (source, destination) pair are cut from that pair's moves and placed in
rounds: bucket k of a pair in round k at its rotation `(dst - src) mod n` (or at the turn
`assign_turns` gives it where turns fill the gaps of uneven pairs). A receiver that got a piece
over the network forwards it to its domain's other replicas in the next forward segment
(`forward_key`), merged per segment. Within a process, `run_order(key, span)` orders its
steps: keys grouped `span` rotations at a time (`group_span` of the staging window: the network
buckets in flight), so that every process posts a group's sends and receives together and no
two processes wait on each other across groups. The staging window (`default_window`) bounds
the buckets a process has in flight: its staging memory. docs/architecture.md draws it.
"""
from __future__ import annotations

import time
from bisect import bisect_left, bisect_right
from collections import defaultdict
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Iterable, Mapping, Optional, Protocol, Sequence

from .._gc import gc_paused
from ..layout.box import Box
from .moves import DOMAIN, LOCAL, NETWORK, Endpoint


class PlanParts(Protocol):
    """What the schedule reads of a plan (`plan.Plan`, which builds its schedule here)."""

    specs: Sequence          # TensorSpec per tensor index
    tensor_plans: Sequence   # TensorPlan per tensor index
    topology: Any            # planner.Topology

    def network_turns(self, bucket_bytes: int) -> Optional[dict]: ...


_new = object.__new__


@dataclass(frozen=True)
class Item:
    """One box of one tensor inside a bucket. `tensor` indexes `Plan.names`."""

    tensor: int
    box: Box


@dataclass(frozen=True)
class Transfer:
    """One bucket from `src` to destination rank `dst` over `path`; executed in `key` order."""

    key: tuple
    src: Endpoint
    dst: int
    path: str
    items: tuple[Item, ...]
    nbytes: int


class Schedule:
    """All transfers of a plan, sorted by a key every rank agrees on.

    Each process runs its own transfers in key order, sends and receives alike. Any total order
    shared by all ranks is deadlock-free when a posted transfer completes once both of its ends
    have posted it: the earliest unfinished transfer always has both ends posted.
    """

    def __init__(self, transfers: Sequence[Transfer], bucket_bytes: int):
        self.transfers = tuple(sorted(transfers, key=lambda t: t.key))
        self.bucket_bytes = bucket_bytes

    def for_endpoints(self, endpoints: Iterable[Endpoint]) -> list[Transfer]:
        eps = set(endpoints)
        return [t for t in self.transfers if t.src in eps or Endpoint("dst", t.dst) in eps]

    def __len__(self) -> int:
        return len(self.transfers)


_PATH_ORDER = {NETWORK: 0, DOMAIN: 1, LOCAL: 2}


def build_schedule(plan: PlanParts, bucket_bytes: int) -> Schedule:
    """Pack moves into buckets per (sender, receiver, path) and order them.

    A network pair's k-th bucket goes in the pair's k-th turn (`Plan.network_turns`): its key
    is (turn // n, network, turn % n, sender, receiver, ...), round and position in a round of
    n = max(n_src, n_dst) positions; in one turn a rank sends at most one network bucket and
    receives at most one. A domain or local pair's k-th bucket sorts at (k, path, rotation, ...),
    after the network buckets of round k.

    Forwarded pieces (a destination passing network pieces on inside its domain) are packed
    per (forwarder, target, path, segment of a round's rotations): what a forwarder passes to
    one target out of its network buckets of that segment, in their key order, into buckets
    that sort into the next segment (`forward_key`), so the domain exchange overlaps the next
    segment's network transfers and costs one ring transfer per target and segment, not one
    per network bucket and target.

    Linear in the number of moves (plus sorting the transfers).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    topo = plan.topology
    n_src = topo.n_src
    isz = [spec.itemsize for spec in plan.specs]

    def gid(ep: Endpoint) -> int:
        return ep.rank if ep.side == "src" else n_src + ep.rank

    # (sender, receiver, path) -> [(item, its bytes, the box of the move it was cut from)]
    pair_items: dict[tuple, list[tuple[Item, int, Box]]] = defaultdict(list)
    # (forwarder dst rank, tensor, box of the network move) -> [(target dst rank, path)]
    forwards: dict[tuple, list[tuple[int, str]]] = defaultdict(list)
    # (forwarder, target, path, round, segment) -> {network bucket key: its entries there}
    fwd_into: dict[tuple, dict] = defaultdict(lambda: defaultdict(list))
    transfers: list[Transfer] = []
    with gc_paused():
        for ti, tp in enumerate(plan.tensor_plans):
            size = isz[ti]
            max_numel = max(1, bucket_bytes // size)
            for m in tp.moves:
                box = m.box
                if m.src.side == "dst":
                    forwards[(m.src.rank, ti, box)].append((m.dst, m.path))
                    continue
                entries = pair_items[(m.src, m.dst, m.path)]
                n = box.numel
                if n <= max_numel:
                    entries.append((Item(ti, box), n * size, box))
                else:
                    for chunk in box.chunks(max_numel):
                        entries.append((Item(ti, chunk), chunk.numel * size, box))

        turns = plan.network_turns(bucket_bytes) if pair_items else {}
        for (src, dst, path), entries in pair_items.items():
            packed = pack_entries(entries, bucket_bytes)
            keys = bucket_keys(len(packed), src.rank, gid(src), dst, path, turns, n_src,
                                topo.n_dst)
            for key, bucket in zip(keys, packed):
                transfers.append(make_transfer(isz, key, src, dst, path, [e[0] for e in bucket],
                                           sum(e[1] for e in bucket)))
                if path != NETWORK:
                    continue
                seg = forward_segment(key[2], n_src, topo.n_dst)
                for entry in bucket:
                    item = entry[0]
                    for target, fpath in forwards.get((dst, item.tensor, entry[2]), ()):
                        fwd_into[(dst, target, fpath, key[0], seg)][key].append(entry)
        for fkey, f, target, fpath, fentries in forward_transfers(fwd_into, bucket_bytes, 1, n_src,
                                                          topo.n_dst):
            transfers.append(make_transfer(isz, fkey, Endpoint("dst", f), target, fpath,
                                       [e[0] for e in fentries], sum(e[1] for e in fentries)))
        return Schedule(transfers, bucket_bytes)


def bucket_starts(sizes, bucket_bytes: int) -> list[int]:
    """Where a pair's buckets after the first start, for entries of these byte sizes.

    The pair's bytes go into n = ceil(total / bucket_bytes) buckets of about equal size: each
    bucket ends at the entry boundary nearest its share of the total, never past
    `bucket_bytes` (an entry larger than that goes alone; where entries do not fit n buckets
    there are more). Equal buckets keep the pairs of a turn (a round, in the rotation
    schedule) alike in size: one whose pairs are uneven runs at the pace of its largest."""
    if sum(sizes) <= bucket_bytes:          # one bucket (most pairs of a large plan)
        return []
    ends = list(accumulate(int(x) for x in sizes))
    n = len(ends)
    total = ends[-1]
    share = total / -(-total // bucket_bytes)
    starts = []
    pos, before, k = 0, 0, 1
    while True:
        # the first entry that would overflow a bucket opened at `pos`
        cap = max(bisect_right(ends, before + bucket_bytes), pos + 1)
        # the entry boundary nearest this bucket's share of the total
        q = k * share
        c = bisect_left(ends, q)
        if c < n and (c == 0 or ends[c] - q <= q - ends[c - 1]):
            c += 1
        nxt = min(cap, max(c, pos + 1))
        if nxt >= n:
            return starts
        starts.append(nxt)
        pos, before, k = nxt, ends[nxt - 1], k + 1


def pack_entries(entries: list, bucket_bytes: int, size_at: int = 1) -> list[list]:
    """`entries` cut into buckets where `bucket_starts` says; `entry[size_at]` is an entry's
    bytes ((item, nbytes, parent) entries by default)."""
    if not entries:
        return []
    cuts = [0, *bucket_starts([e[size_at] for e in entries], bucket_bytes), len(entries)]
    return [entries[a:b] for a, b in zip(cuts, cuts[1:])]


def bucket_count(sizes, bucket_bytes: int) -> int:
    """How many buckets `bucket_starts` cuts entries of these byte sizes into, mostly without
    cutting: n = ceil(total / bucket_bytes) wherever each bucket's share plus the largest entry
    fits a bucket (each bucket then ends within half an entry of its share)."""
    total = sum(sizes)
    if total <= bucket_bytes:
        return 1
    n = -(-total // bucket_bytes)
    if total / n + max(sizes) <= bucket_bytes:
        return n
    return len(bucket_starts(sizes, bucket_bytes)) + 1


# Counting every network pair's buckets exactly walks each (tensor, network pair) entry of the
# plan once, about 0.5 us each here: up to this many (a second or two, once per plan, on the
# driver) network buckets go in turns; larger plans keep the rotation schedule.
TURNS_MAX_ENTRIES = 2_000_000
# Turns replace the rotation schedule only where they take this much fewer positions.
TURNS_MIN_GAIN = 0.05


def network_entries(plan: PlanParts) -> int:
    """How many (tensor, network pair) entries `network_bucket_counts` walks."""
    return sum(tp.n_network_pairs() for tp in plan.tensor_plans)


def network_bucket_counts(plan: PlanParts, bucket_bytes: int) -> dict[tuple[int, int], int]:
    """{(source rank, destination rank): how many buckets of at most `bucket_bytes` the
    schedule cuts that network pair into}, from the whole plan's moves (per distinct tensor
    plan, renamed per tensor)."""
    return {pair: n for pair, (n, _) in network_buckets(plan, bucket_bytes).items()}


def network_buckets(plan: PlanParts, bucket_bytes: int, deadline: Optional[float] = None
                     ) -> dict[tuple[int, int], tuple[int, int]]:
    """{network pair: (its buckets, its bytes)} (see `network_bucket_counts`)."""
    sizes: dict[tuple[int, int], list] = {}
    with gc_paused():
        for ti, tp in enumerate(plan.tensor_plans):
            if deadline is not None and not ti % DEADLINE_EVERY:
                check_deadline(deadline, "cutting network buckets")
            isz = plan.specs[ti].itemsize
            for s, d, piece_sizes in tp.network_pieces(max(1, bucket_bytes // isz), isz):
                got = sizes.get((s, d))
                if got is None:
                    sizes[(s, d)] = list(piece_sizes)
                else:
                    got += piece_sizes
        return {pair: (bucket_count(v, bucket_bytes), sum(v)) for pair, v in sizes.items()}


# A network pair whose buckets average under bucket_bytes / SMALL_BUCKET takes its turns after
# the others (see `assign_turns`).
SMALL_BUCKET = 4


def assign_turns(counts: Mapping[tuple[int, int], int], n_rot: int,
                 late: Iterable[tuple[int, int]] = ()) -> dict[tuple[int, int], tuple]:
    """The turn of every network bucket: {(source rank, destination rank): the turns of that
    pair's buckets, increasing}. In one turn a source sends at most one bucket and a
    destination receives at most one; a bucket's key is (turn // n_rot, ..., turn % n_rot):
    its round and its position in the round.

    First fit in the rotation schedule's order: bucket k of every pair, by k, then by rotation
    `(dst - src) mod n_rot`, takes the earliest turn after the pair's previous bucket where
    neither end is busy. Where every pair has as many buckets this is the rotation schedule
    (round k, position = rotation); where pairs differ, the buckets of busier ranks fill the
    turns lighter pairs leave free instead of trailing in sparse late rounds, so a rank's
    buckets take about as many turns as it has buckets (the most any schedule needs is the
    largest such count: each turn is a matching). Deterministic: every process computes the
    same turns from the same counts.

    The pairs in `late` (small buckets: a turn counts them as much as a full one, though they
    take little time) take their turns after all the others have theirs, in the gaps those
    leave or after them, so they do not push full buckets of the busiest ranks back."""
    late = frozenset(late)
    with gc_paused():
        busy_src: dict[int, int] = defaultdict(int)       # bit t set: busy in turn t
        busy_dst: dict[int, int] = defaultdict(int)
        out: dict[tuple[int, int], tuple] = {}
        for first in (True, False):
            out.update(first_fit({pair: c for pair, c in counts.items()
                                   if (pair in late) != first}, n_rot, busy_src, busy_dst))
        return out


def first_fit(counts: Mapping[tuple[int, int], int], n_rot: int, busy_src: dict,
               busy_dst: dict) -> dict:
    pairs = sorted(counts, key=lambda sd: ((sd[1] - sd[0]) % n_rot, sd))
    out: dict[tuple[int, int], list] = {pair: [] for pair in pairs}
    k = 0
    while pairs:
        for pair in pairs:
            s, d = pair
            got = out[pair]
            lo = got[-1] + 1 if got else 0
            free = ~(busy_src[s] | busy_dst[d]) >> lo
            t = lo + (free & -free).bit_length() - 1
            busy_src[s] |= 1 << t
            busy_dst[d] |= 1 << t
            got.append(t)
        k += 1
        pairs = [pair for pair in pairs if counts[pair] > k]
    return {pair: tuple(v) for pair, v in out.items()}


def bucket_keys(n: int, src_rank: int, gsrc: int, dst: int, path: str, turns: Optional[dict],
                 n_src: int, n_dst: int) -> list[tuple]:
    """The keys of a source-to-destination pair's n buckets (`gsrc`: the sender's number in
    the key, sources first): a network pair's at its turns
    (round, network, position in the round, ...), the others (and network pairs where `turns`
    is None) at (k, path, rotation, ...)."""
    if path != NETWORK or turns is None:
        rot = rotation(src_rank, dst, n_src, n_dst)
        return [(k, _PATH_ORDER[path], rot, gsrc, dst, 0, -1) for k in range(n)]
    pair_turns = turns.get((src_rank, dst), ())
    if len(pair_turns) != n:
        raise RuntimeError(f"network pair src {src_rank} -> dst {dst}: {n} buckets, but the "
                           f"plan's turn table has {len(pair_turns)} (planner bug)")
    n_rot = max(n_src, n_dst)
    return [(t // n_rot, _PATH_ORDER[NETWORK], t % n_rot, gsrc, dst, 0, -1) for t in pair_turns]


# Staging memory a process may hold for network buckets in flight, by default.
DEFAULT_STAGING_BYTES = 128 << 20
MAX_WINDOW = 16


def default_window(bucket_bytes: int, staging_bytes: int = DEFAULT_STAGING_BYTES) -> int:
    """Staged buckets in flight per process (the executor's window): as many as fit in
    `staging_bytes`, at least 2 (double buffering), at most MAX_WINDOW."""
    return max(2, min(MAX_WINDOW, staging_bytes // max(1, bucket_bytes)))


def group_span(window: int, round_len: int = 0) -> int:
    """How many positions of a round one network group spans (0: each bucket its own group):
    `window // 2`, so a group holds at most that many sends and as many receives, but at most
    half a round of `round_len` positions (0: no limit), so a round is at least two groups and
    one is in flight while the next is packed."""
    span = window // 2
    return min(span, max(1, round_len // 2)) if round_len else span


def rotation(src: int, dst: int, n_src: int, n_dst: int) -> int:
    """The rotation of the pair (source rank `src`, destination rank `dst`):
    `(dst - src) mod max(n_src, n_dst)`. In one rotation every source rank sends to at most
    one destination rank and every destination rank receives from at most one source rank, and
    the rotations are as few as that allows, so all pairs are met in max(n_src, n_dst) steps of
    disjoint pairs. It is the position of a domain or local pair's buckets in their rounds, and
    the order in which network buckets take their turns (`assign_turns`)."""
    return (dst - src) % max(n_src, n_dst)


# A forwarded bucket's key holds this where a network bucket's holds its sender: it sorts after
# the network buckets of its rotation.
FORWARDED = 1 << 40
# Forwards are merged per segment of a round's rotations and sent during the next segment: at
# most this many segments per round, each at least SEGMENT_ROTATIONS rotations wide (narrower
# segments put a ring run, which waits for its peers, between too few network buckets).
FORWARD_SEGMENTS = 4
SEGMENT_ROTATIONS = 16


def forward_segment(rotation_: int, n_src: int, n_dst: int) -> int:
    """The segment of a round that a network bucket at position `rotation_` falls in."""
    n_rot = max(n_src, n_dst)
    return rotation_ * forward_segments(n_src, n_dst) // n_rot


def forward_segments(n_src: int, n_dst: int) -> int:
    """How many segments each round's rotations are cut into (see `forward_segment`)."""
    return max(1, min(FORWARD_SEGMENTS, max(n_src, n_dst) // SEGMENT_ROTATIONS))


def segment_rotations(segment: int, n_src: int, n_dst: int) -> range:
    """The rotations of a round that segment `segment` holds."""
    n_rot, segments = max(n_src, n_dst), forward_segments(n_src, n_dst)
    return range(segment * n_rot // segments, (segment + 1) * n_rot // segments)


def forward_key(round_: int, segment: int, forwarder: int, target: int, path: str, chunk: int,
                parent: tuple, n_src: int, n_dst: int) -> tuple:
    """Order key of forwarded bucket `chunk` from `forwarder` to `target`: what the forwarder
    passes on to that target out of its network buckets of one segment of round `round_`,
    merged and cut into buckets. `parent` is the key of the last network bucket whose data it
    holds (a process's network buckets complete in key order, so the others have completed by
    then).

    The chunks go into the next segment (of this round, or the first of the next), spread over
    its rotations: chunk c of the pair at ring rotation j = (target - forwarder) mod n_dst sorts
    right after the network buckets of the segment's rotation (j + c) mod its width. So a
    forwarder passes a segment on while the next one's network receives are in flight, instead
    of all at once between two rounds, and what is left after the last network bucket is one
    segment's forwarding. Within a rotation, forwards go by ring rotation (each forwarder sends
    to one target and each target takes from one forwarder per ring rotation), then by
    descending forwarder: every forwarder but the few lowest sends before it receives, so the
    domain's forwards do not wait on each other in a chain."""
    segments = forward_segments(n_src, n_dst)
    nxt_round, nxt = divmod(round_ * segments + segment + 1, segments)
    rots = segment_rotations(nxt, n_src, n_dst)
    j = (target - forwarder) % n_dst
    return (nxt_round, _PATH_ORDER[NETWORK], rots[(j + chunk) % len(rots)], FORWARDED, j,
            -forwarder, target, _PATH_ORDER[path], chunk, parent[0], parent[2], parent[3])


def is_forward_key(key: tuple) -> bool:
    """True for the key of a forwarded bucket (see `forward_key`)."""
    return len(key) > 3 and key[3] == FORWARDED


def parent_key(forward: "Transfer") -> tuple:
    """Key of the last network bucket whose data a forwarded bucket passes on."""
    k = forward.key
    return (k[9], _PATH_ORDER[NETWORK], k[10], k[11], -k[5], 0, -1)


def run_order(key: tuple, span: int) -> tuple:
    """Where a step runs when network buckets are posted in groups of `span` rotations: the
    key order, except that forwarded buckets sorting inside a group's rotations run right after
    that group (so a group is never cut in two). Every process uses the same order."""
    if key[1] != _PATH_ORDER[NETWORK] or span <= 1:
        return key
    return (key[0], key[1], key[2] // span, key[3] == FORWARDED) + key[2:]


def forward_transfers(fwd_into: dict, bucket_bytes: int, size_at: int, n_src: int, n_dst: int):
    """(key, forwarder, target, path, entries) of every forwarded bucket, from `fwd_into`
    {(forwarder, target, path, round, segment): {network bucket key: entries}}."""
    for (f, target, fpath, k, seg), parts in fwd_into.items():
        for c, (parent, fentries) in enumerate(forward_buckets(parts, bucket_bytes, size_at)):
            yield (forward_key(k, seg, f, target, fpath, c, parent, n_src, n_dst), f, target,
                   fpath, fentries)


def forward_buckets(parts: dict, bucket_bytes: int, size_at: int) -> list[tuple]:
    """One (forwarder, target, path, round, segment)'s forwarded entries, `parts` {network key:
    entries}, in network key order cut into buckets of at most `bucket_bytes`:
    [(key of the last network bucket drawn from, entries)]."""
    out, cur, cur_bytes, last = [], [], 0, None
    for key in sorted(parts):
        for e in parts[key]:
            nb = e[size_at]
            if cur and cur_bytes + nb > bucket_bytes:
                out.append((last, cur))
                cur, cur_bytes = [], 0
            cur.append(e)
            cur_bytes += nb
            last = key
    if cur:
        out.append((last, cur))
    return out


def items_of(entries) -> list[Item]:
    """Item(tensor, box) of each (nbytes, tensor, box, parent box) entry of a share, without
    the frozen-dataclass __init__ (one per piece)."""
    out = []
    append = out.append
    new = _new
    for _, tensor, box, _ in entries:
        it = new(Item)
        d = it.__dict__
        d["tensor"] = tensor
        d["box"] = box
        append(it)
    return out


def make_transfer(isz, key, src, dst, path, items: list, nbytes: int) -> Transfer:
    # Items sit back to back in the flat buffer. Largest element size first keeps every item's
    # byte offset a multiple of its element size (sizes are powers of two), as viewing a byte
    # buffer as a wider dtype requires: an fp32 item after a bf16 one could start at byte 2.
    if len({isz[it.tensor] for it in items}) > 1:
        items.sort(key=lambda it: -isz[it.tensor])
    return Transfer(key, src, dst, path, tuple(items), nbytes)


def network_turns(plan: PlanParts, bucket_bytes: int, deadline: Optional[float] = None
                  ) -> Optional[dict]:
    """{(source rank, destination rank): the turns of that network pair's buckets} for buckets
    of `bucket_bytes` (see `assign_turns`).

    None where the network buckets keep the rotation schedule (bucket k of a pair in round k,
    at its rotation): where the plan has more than TURNS_MAX_ENTRIES (tensor, network pair)
    entries, or where turns would not take at least TURNS_MIN_GAIN fewer positions than the
    rotation schedule occupies (its (round, rotation) positions holding a bucket: a position
    one rank waits through for another costs about one bucket's time). Past `deadline` it
    stops with PlanTimeout."""
    if network_entries(plan) > TURNS_MAX_ENTRIES:
        return None
    pairs = network_buckets(plan, bucket_bytes, deadline)
    n_src, n_dst = plan.topology.n_src, plan.topology.n_dst
    turns = assign_turns({pair: n for pair, (n, _) in pairs.items()}, max(n_src, n_dst),
                         late={pair for pair, (n, nbytes) in pairs.items()
                               if nbytes < n * (bucket_bytes // SMALL_BUCKET)})
    occupied = len({(k, rotation(s, d, n_src, n_dst))
                    for (s, d), (n, _) in pairs.items() for k in range(n)})
    used = 1 + max((ts[-1] for ts in turns.values()), default=-1)
    if used > (1 - TURNS_MIN_GAIN) * occupied:
        return None
    return turns


class PlanTimeout(TimeoutError):
    """Planning ran past the refit's deadline."""


# Planning loops look at the clock once per this many tensors.
DEADLINE_EVERY = 256


def check_deadline(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise PlanTimeout(f"the refit's deadline passed during {what}")


