"""Delta refits: each network bucket travels as the bytes that changed since its sender's
baseline, applied by the receiver onto what it holds (the protocol: docs/delta.md). The
driver's `DeltaRequest`, a sender's `Baselines` (kept across refits, confirmed by `settle`) and
one process's `DeltaRun`; the executor posts headers and payloads group by group.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..execution import codecs, delta as codec
from ..execution.program import SEND, RECV
from ..planning.moves import NETWORK

BASELINE_PLACES = ("device", "host")
HEADER = 3                      # int64 per bucket: encoding, payload bytes, checksum


class DeltaMismatch(RuntimeError):
    """A receiver's bytes did not become the sender's after applying a delta: its destination
    shards were changed outside refits since the baseline's version."""


class Baselines:
    """A sender's baselines for one program: step key -> the bytes of that network bucket it
    sent last, with the version they belong to (None: not confirmed) and a version written
    but not yet confirmed (`pending`)."""

    def __init__(self, place: str):
        if place not in BASELINE_PLACES:
            raise ValueError(f"delta baseline place must be one of {BASELINE_PLACES}, got "
                             f"{place!r}")
        self.place = place
        self.version: Optional[int] = None
        self.pending: Optional[int] = None
        self.buffers: dict = {}
        self.scratch: dict = {}       # (device, use) -> bucket-sized scratch buffer

    def settle(self, committed: int) -> None:
        """The group's version is `committed`: a pending baseline of that version holds."""
        if self.pending is not None:
            self.version = self.pending if self.pending == committed else None
            self.pending = None

    def drop(self) -> None:
        self.version = self.pending = None
        self.buffers.clear()
        self.scratch.clear()

    @property
    def nbytes(self) -> int:
        """Memory held: baselines and scratch buffers."""
        return sum(t.numel() for t in (*self.buffers.values(), *self.scratch.values()))

    def scratch_for(self, nbytes: int, device: torch.device, use: str = "bucket"
                    ) -> torch.Tensor:
        buf = self.scratch.get((device, use))
        if buf is None or buf.numel() < nbytes:
            buf = self.scratch[(device, use)] = (
                _host(nbytes, pin=True) if use.startswith("host") else
                torch.empty(nbytes, dtype=torch.uint8, device=device))
        return buf[:nbytes]


def _host(nbytes: int, pin: bool) -> torch.Tensor:
    """Host memory for a bucket (pinned for a GPU's copies)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def granule_of(part) -> int:
    """The granule of a bucket from its items' wire dtypes (the same on both ends)."""
    return codec.granule(part.nbytes, min(w.itemsize for w in part.wire))


class DeltaRun:
    """One delta refit of one process: the version exchange before its program, then per
    network bucket its encoding (`encode`, a sender), its header and payload, and how to apply
    it (`apply`, a receiver)."""

    def __init__(self, baselines: Baselines, version: int, held: Optional[int],
                 device: torch.device, pid: int, only: Optional[frozenset] = None,
                 held_keys: Optional[list] = None):
        """`only`: indices of the tensors sent as deltas (None: all); a bucket holding any
        other travels dense and keeps no baseline. `held_keys`: the program's held shards
        ((side, rank, tensor) per held index), to find a bucket's tensors."""
        self.baselines, self.version, self.held, self.device = baselines, version, held, device
        self.pid = pid
        self.only, self.held_keys = only, held_keys
        self.codec = codecs.codec_for(device)
        self.ok: dict = {}            # receiving process -> whether it holds the baseline's
        self.sends: dict = {}         # step key -> (kind, size, dense bytes or None)
        self.headers: dict = {}       # step key -> (kind, size, checksum) of a receive
        self.encodings = {name: 0 for name in codec.KINDS.values()}
        self.granules = self.changed = 0
        self.dense_bytes = self.sent_bytes = 0
        self.fallbacks: list = []
        self.mismatches: list = []
        self.deferred: list = []      # baselines to complete once their sends are posted
        self.unchecked: list = []     # SAME receives whose checksum is checked at the end
        self.clock = {"versions": 0.0, "encode": 0.0, "headers": 0.0, "apply": 0.0}

    # ------------------------------------------------------------------ before the program
    def start(self, steps: list, net, deadline: float) -> None:
        """Exchange versions: decide, per receiving process, delta or dense."""
        t0 = time.perf_counter()
        sends = [s for s in steps if s.kind == SEND and s.path == NETWORK]
        recvs = [s for s in steps if s.kind == RECV and s.path == NETWORK]
        to = sorted({s.peer for s in sends})
        frm = sorted({s.peer for s in recvs})
        mine = torch.tensor([-1 if self.held is None else self.held], dtype=torch.int64,
                            device=self.device)
        theirs = {p: torch.empty(1, dtype=torch.int64, device=self.device) for p in to}
        ops = [(p, mine, True) for p in frm] + [(p, theirs[p], False) for p in to]
        if ops:
            net.complete(net.post_group(ops), deadline, "delta: versions")
        held = {p: int(t.item()) for p, t in theirs.items()}
        b = self.baselines
        base_version = b.version
        b.version, b.pending = None, self.version      # rewritten from here on
        for p in to:
            self.ok[p] = base_version is not None and held[p] == base_version
            if not self.ok[p]:
                theirs_v = "an unknown version" if held[p] < 0 else f"v{held[p]}"
                why = ("no baseline yet" if base_version is None else
                       f"it holds {theirs_v}, the baseline is v{base_version}")
                self.fallbacks.append(f"process {self.pid} -> {p}: dense ({why})")
        self.clock["versions"] = time.perf_counter() - t0

    # ------------------------------------------------------------------ a sender
    def encode(self, s, out: torch.Tensor) -> list:
        """Encode network send `s` into `out` (a staging buffer of at least its bytes, on the
        process's device) and keep the new bytes as its baseline; returns its header."""
        t0 = time.perf_counter()
        b, part, n = self.baselines, s.send, s.nbytes
        g = granule_of(part)
        self.dense_bytes += n
        self.granules += n // g
        if self.only is not None and not self.only.issuperset(
                self.held_keys[h][2] for h in part.held):
            b.buffers.pop(s.key, None)              # dense by request: no baseline kept
            if s.per_item:                          # items in place, as a dense refit does
                self.sends[s.key] = (codec.DENSE, n, None, False)
            else:
                part.pack(out)
                self.sends[s.key] = (codec.DENSE, n, out[:n], True)
            self._count(codec.DENSE, n, 0)
            self.clock["encode"] += time.perf_counter() - t0
            return [codec.DENSE, n, 0]
        base = b.buffers.get(s.key)
        fresh = base is None or base.numel() != n
        if fresh:
            base = b.buffers[s.key] = (torch.empty(n, dtype=torch.uint8, device=self.device)
                                       if b.place == "device" else
                                       _host(n, self.device.type == "cuda"))
        rows = (part.byte_rows() if self.device.type == "cpu" and self.codec.name == "host"
                else None)
        # A bucket whose items all travel in place from plain host memory: a dense result's
        # copy into the baseline waits until its send is posted (`finish`), so the bytes are on
        # the wire meanwhile.
        defer = s.per_item and rows is not None and base.device == self.device
        if fresh or not (self.ok[s.peer] and s.delta_ok):
            if defer:
                self.deferred.append(lambda: part.pack(base, cache=False))
            else:
                self._refresh(part, base, out)
            enc = codec.Encoded(codec.DENSE, n, n // g)
        else:
            enc = self._encode(part, base, out, g, n, rows, defer)
            if enc.rest is not None:
                self.deferred.append(lambda: self.codec.finish(enc))
        if enc.kind == codec.DENSE:
            # the new bytes: the baseline, untouched until the next refit; a host baseline of
            # a GPU's bucket left them in `out` too (see _refresh, _encode)
            on_out = base.device != self.device
            self.sends[s.key] = (codec.DENSE, n, out[:n] if on_out else base, on_out)
        else:
            self.sends[s.key] = (enc.kind, enc.nbytes, None, enc.kind != codec.SAME)
        self._count(enc.kind, enc.nbytes, enc.changed)
        self.clock["encode"] += time.perf_counter() - t0
        return [enc.kind, enc.nbytes, enc.check]

    def finish(self) -> None:
        """Complete the baselines left until their sends were posted (see `encode`)."""
        if self.deferred:
            t0 = time.perf_counter()
            for fn in self.deferred:
                fn()
            self.deferred.clear()
            self.clock["encode"] += time.perf_counter() - t0

    def _refresh(self, part, base: torch.Tensor, out: torch.Tensor) -> None:
        """The baseline takes the bucket's new bytes (a bucket sent dense)."""
        if base.device == self.device:
            part.pack(base, cache=False)
        else:
            part.pack(out)
            base.copy_(out[:base.numel()])

    def _encode(self, part, base: torch.Tensor, out: torch.Tensor, g: int, n: int, rows,
                defer: bool) -> codec.Encoded:
        b = self.baselines
        if self.device.type == "cpu":
            if rows is None:
                new = b.scratch_for(n, self.device)
                part.pack(new)
                rows = new
            if self.codec.name == "host":
                return self.codec.encode(rows, base, out, g, probe=True, defer=defer)
            return self.codec.encode(rows, base, out, g, probe=True)
        new = b.scratch_for(n, self.device)
        part.pack(new)
        if base.device == self.device:
            return self.codec.encode(new, base, out, g)
        # a host baseline of a GPU's bucket: compared on the host, the payload copied back
        host = codecs.codec_for(base.device)
        cur = b.scratch_for(n, base.device, "host new")
        cur.copy_(new)
        hout = b.scratch_for(n, base.device, "host out")
        enc = host.encode(cur, base, hout, g, probe=True)
        if enc.kind in (codec.MASK, codec.INDEX):
            out[:enc.nbytes].copy_(enc.payload, non_blocking=True)
        elif enc.kind == codec.DENSE:
            out[:n].copy_(new)
        return enc

    def _count(self, kind: int, size: int, changed: int) -> None:
        self.encodings[codec.KINDS[kind]] += 1
        self.sent_bytes += size
        self.changed += changed

    def send(self, s) -> tuple:
        """(kind, payload bytes, the new bytes of a DENSE one (None: send the part's items
        as a dense refit does), whether what travels lies in the `out` buffer `encode` was
        given) of an encoded send."""
        return self.sends[s.key]

    # ------------------------------------------------------------------ a receiver
    def take_header(self, s, row) -> None:
        """The header of network receive `s`, as its sender sent it."""
        kind, size, check = (int(x) for x in row)
        if not 0 <= size <= s.nbytes or kind not in codec.KINDS or \
                (kind == codec.DENSE and size != s.nbytes):
            raise ValueError(f"delta header from process {s.peer} for a {s.nbytes}-byte "
                             f"bucket: encoding {kind}, {size} bytes")
        self.headers[s.key] = (kind, size, check)

    def header(self, s) -> tuple:
        return self.headers[s.key]

    def wire_bytes(self, s) -> int:
        """Bytes a network bucket's payload took on the wire."""
        return self.sends[s.key][1] if s.kind == SEND else self.headers[s.key][1]

    def check_later(self, s) -> None:
        """A SAME bucket's check waits for `run_checks`: its regions are not written in this
        refit, so what they are forwarded from is already final; forwards go first."""
        self.unchecked.append(s)

    def run_checks(self) -> None:
        """The checks `check_later` left (a mismatch is recorded in `mismatches`)."""
        for s in self.unchecked:
            self.apply(s, None)
        self.unchecked.clear()

    def apply(self, s, buf: Optional[torch.Tensor]) -> None:
        """Apply a received MASK or INDEX payload `buf` (None: SAME) onto the receiving part's
        regions and check the result; a mismatch is recorded in `mismatches`."""
        t0 = time.perf_counter()
        kind, size, check = self.headers[s.key]
        part, n = s.recv, s.nbytes
        g = granule_of(part)
        rows = (part.byte_rows() if self.device.type == "cpu" and self.codec.name == "host"
                else None)
        if rows is not None:
            got = self.codec.apply(kind, buf, rows, g)
        else:
            cur = self.baselines.scratch_for(n, self.device)
            part.pack(cur)
            got = self.codec.apply(kind, buf, cur, g)
            if kind != codec.SAME and got == check:
                part.unpack(cur)
        if got != check:
            self.mismatches.append(
                f"a {n}-byte bucket from process {s.peer} does not match after applying its "
                f"delta (checksum {got} != {check}): the destination shards changed outside "
                f"refits since v{self.held}")
        self.clock["apply"] += time.perf_counter() - t0

    def stats(self) -> dict:
        return {"network_bytes": self.sent_bytes, "dense_network_bytes": self.dense_bytes,
                "granules": self.granules, "changed_granules": self.changed,
                "encodings": dict(self.encodings),
                "fallbacks": list(self.fallbacks), "mismatches": list(self.mismatches),
                "baseline_bytes": self.baselines.nbytes, "clock": dict(self.clock)}


def summarize(per: list) -> Optional[dict]:
    """A delta refit's figures from every process's: network bytes sent (payloads) and what a
    dense refit sends, granules compared and found changed, buckets per encoding, the
    sender->receiver pairs sent dense and why, receivers whose bytes did not match, and the
    largest baseline memory of a process."""
    parts = [st["delta"] for st in per if "delta" in st]
    if not parts:
        return None
    out = {k: sum(d[k] for d in parts) for k in
           ("network_bytes", "dense_network_bytes", "granules", "changed_granules")}
    out["encodings"] = {k: sum(d["encodings"][k] for d in parts) for k in parts[0]["encodings"]}
    out["fallbacks"] = [f for d in parts for f in d["fallbacks"]]
    out["mismatches"] = [f for d in parts for f in d.get("mismatches", ())]
    out["baseline_bytes"] = max(d["baseline_bytes"] for d in parts)
    return out


@dataclass(frozen=True)
class DeltaRequest:
    """What a delta refit asks of every process: where senders keep their baselines
    (`baseline_place`, one of `BASELINE_PLACES`) and the spec names sent as deltas (`names`,
    sorted; None: all). Buckets holding any other tensor travel dense."""

    baseline_place: str
    names: Optional[tuple] = None

    def __post_init__(self):
        if self.baseline_place not in BASELINE_PLACES:
            raise ValueError(f"delta baseline place must be one of {BASELINE_PLACES}, got "
                             f"{self.baseline_place!r}")


def request(delta, specs, baseline_place: str) -> Optional[DeltaRequest]:
    """A refit's `delta` argument checked against its spec set, before anything moves: its
    `DeltaRequest`, or None for a dense refit. `delta` is a bool, or a collection of spec
    names: only buckets all of whose tensors are among them travel as deltas, the others
    dense (an empty collection: a dense refit)."""
    if isinstance(delta, bool):
        return DeltaRequest(baseline_place) if delta else None
    if isinstance(delta, (str, bytes)) or not hasattr(delta, "__iter__"):
        raise TypeError(f"delta must be True, False or a collection of spec names, got "
                        f"{delta!r}")
    names = tuple(sorted(set(delta)))
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise ValueError(f"delta names {unknown[:5]} are not in this refit's specs")
    return DeltaRequest(baseline_place, names) if names else None


def run_for(program, req: DeltaRequest, version: int, held: Optional[int],
            device: torch.device, pid: int) -> DeltaRun:
    """A process's `DeltaRun` of `req` for an installed program (`program.baselines`, kept
    across refits; `program.plan`, `program.compiled`)."""
    if program.baselines is None or program.baselines.place != req.baseline_place:
        program.baselines = Baselines(req.baseline_place)
    only = None if req.names is None else frozenset(
        i for i, n in enumerate(program.plan.names) if n in req.names)
    return DeltaRun(program.baselines, version, held, device, pid, only,
                    program.compiled.held)
