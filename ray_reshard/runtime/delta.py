"""Delta refits: each network bucket travels as the bytes that changed since the sender's
baseline, applied by the receiver onto what it holds (see docs/delta.md for the protocol).

A sender keeps, per installed program, a baseline: the bytes of each network bucket it sent in
its last delta refit (`Baselines`, in device or host memory). Before its network transfers a
process running a delta refit
1. tells each process it sends to nothing and each it receives from the version its
   destination shards hold (`held`: the group version of the last refit that finished in it,
   None when unknown), one small message per peer;
2. as a sender, packs each network bucket, encodes it against its baseline where the receiver
   holds the baseline's version (else it travels DENSE: a fallback, named in the stats), and
   stores the new bytes as the baseline; then sends each receiver one header per bucket
   (encoding, payload bytes, checksum of the new bytes);
3. runs its program with each network bucket's payload in place of its bytes: a receiver packs
   its destination regions (the baseline's bytes), applies the payload, checks the checksum
   and unpacks; a DENSE payload is unpacked as is, a SAME one is not sent.
The baseline's version is confirmed only when the driver says the refit finished everywhere
(`Baselines.settle`); a refit that failed leaves it unconfirmed, so the next one is dense.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from ..execution import delta as codec
from ..execution.program import SEND, RECV
from ..planning.planner import NETWORK

BASELINE_PLACES = ("device", "host")
_HEADER = 3                     # int64 per bucket: encoding, payload bytes, checksum


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
        self.scratch: dict = {}       # device -> bucket-sized scratch buffer

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

    def scratch_for(self, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self.scratch.get(device)
        if buf is None or buf.numel() < nbytes:
            buf = self.scratch[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]


def _host(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def granule_of(part) -> int:
    """The granule of a bucket from its items' wire dtypes (the same on both ends)."""
    return codec.granule(part.nbytes, min(w.itemsize for w in part.wire))


class DeltaRun:
    """One delta refit of one process: the exchanges before its program runs, then per network
    bucket the payload to send (`message`), its size (`size`) and how to apply it (`apply`)."""

    def __init__(self, baselines: Baselines, version: int, held: Optional[int],
                 device: torch.device, pid: int):
        self.baselines, self.version, self.held, self.device = baselines, version, held, device
        self.pid = pid
        self.messages: dict = {}      # step key -> payload to send (None: SAME)
        self.headers: dict = {}       # step key -> (kind, size, checksum) of a receive
        self.encodings = {name: 0 for name in codec.KINDS.values()}
        self.granules = self.changed = 0
        self.dense_bytes = self.sent_bytes = 0
        self.fallbacks: list = []
        self.clock: dict = {}
        self.clock_parts = {"pack": 0.0, "compare": 0.0, "keep": 0.0}

    # ------------------------------------------------------------------ before the program
    def start(self, steps: list, net, deadline: float) -> None:
        """Exchange versions, encode this process's network sends, exchange headers."""
        now = time.perf_counter
        t0 = now()
        sends = [s for s in steps if s.kind == SEND and s.path == NETWORK]
        recvs = [s for s in steps if s.kind == RECV and s.path == NETWORK]
        to = sorted({s.peer for s in sends})
        frm = sorted({s.peer for s in recvs})
        mine = torch.tensor([-1 if self.held is None else self.held], dtype=torch.int64,
                            device=self.device)
        theirs = {p: torch.empty(1, dtype=torch.int64, device=self.device) for p in to}
        self._exchange(net, [(p, mine, True) for p in frm] +
                       [(p, theirs[p], False) for p in to], deadline, "delta: versions")
        held = {p: int(t.item()) for p, t in theirs.items()}
        t1 = now()
        b = self.baselines
        base_version = b.version
        b.version, b.pending = None, self.version      # rewritten from here on
        out = {p: [] for p in to}
        named: set = set()             # peers whose fallback is named already
        for s in sends:
            ok = base_version is not None and held[s.peer] == base_version
            if not ok and s.peer not in named:
                named.add(s.peer)
                theirs = "an unknown version" if held[s.peer] < 0 else f"v{held[s.peer]}"
                why = ("no baseline yet" if base_version is None else
                       f"it holds {theirs}, the baseline is v{base_version}")
                self.fallbacks.append(f"process {self.pid} -> {s.peer}: dense ({why})")
            out[s.peer].extend(self._encode(s, ok and s.delta_ok))
        t2 = now()
        heads = {p: torch.tensor(v, dtype=torch.int64, device=self.device) for p, v in out.items()}
        got = {p: torch.empty(_HEADER * sum(1 for s in recvs if s.peer == p), dtype=torch.int64,
                              device=self.device) for p in frm}
        self._exchange(net, [(p, t, True) for p, t in heads.items()] +
                       [(p, t, False) for p, t in got.items()], deadline, "delta: headers")
        rows = {p: t.view(-1, _HEADER).tolist() for p, t in got.items()}
        self.clock = {"versions": t1 - t0, "encode": t2 - t1, "headers": now() - t2,
                      **{f"encode_{k}": v for k, v in self.clock_parts.items()}}
        at = {p: 0 for p in frm}
        for s in recvs:
            kind, size, check = rows[s.peer][at[s.peer]]
            at[s.peer] += 1
            if not 0 <= size <= s.nbytes or kind not in codec.KINDS:
                raise ValueError(f"delta header from process {s.peer} for a {s.nbytes}-byte "
                                 f"bucket: encoding {kind}, {size} bytes")
            self.headers[s.key] = (kind, size, check)

    @staticmethod
    def _exchange(net, ops: list, deadline: float, what: str) -> None:
        if ops:
            net.complete(net.post_group(ops), deadline, what)

    def _encode(self, s, delta: bool) -> list:
        """Pack a network send, encode it against its baseline (when `delta`), keep the new
        bytes as the baseline; returns its header."""
        b, part, n = self.baselines, s.send, s.nbytes
        base = b.buffers.get(s.key)
        fresh = base is None or base.numel() != n
        if fresh:
            base = b.buffers[s.key] = (torch.empty(n, dtype=torch.uint8, device=self.device)
                                       if b.place == "device" else _host(n, self.device))
        self.dense_bytes += n
        g = granule_of(part)
        self.granules += n // g
        if not delta or fresh:
            if base.device == self.device:
                part.pack(base, cache=False)
                msg = base
            else:                              # a host baseline of a GPU's bucket
                new = b.scratch_for(n, self.device)
                part.pack(new)
                base.copy_(new)
                msg = base.to(self.device)
            self._count(codec.DENSE, n, n // g)
            self.messages[s.key] = msg
            return [codec.DENSE, n, 0]
        t0 = time.perf_counter()
        new = b.scratch_for(n, self.device)
        part.pack(new)
        cur = new
        if base.device != new.device:          # a host baseline: compare on the host
            cur = b.scratch_for(n, base.device) if base.device.type == "cpu" else new
            cur.copy_(new)
        t1 = time.perf_counter()
        enc = codec.encode(cur, base, g)
        t2 = time.perf_counter()
        if cur is new and b.scratch[self.device].numel() == n:
            # the new bytes become the baseline and the old baseline the scratch: no copy
            b.buffers[s.key], b.scratch[self.device] = b.scratch[self.device], base
            base = b.buffers[s.key]
        else:
            base.copy_(cur)
        self.clock_parts["pack"] += t1 - t0
        self.clock_parts["compare"] += t2 - t1
        self.clock_parts["keep"] += time.perf_counter() - t2
        if enc.kind == codec.DENSE:
            msg = base if base.device == self.device else base.to(self.device)
        elif enc.kind == codec.SAME:
            msg = None
        else:
            msg = enc.payload.to(self.device)
        self.messages[s.key] = msg
        self._count(enc.kind, 0 if msg is None else msg.numel(), enc.changed)
        return [enc.kind, 0 if msg is None else msg.numel(), enc.check]

    def _count(self, kind: int, size: int, changed: int) -> None:
        self.encodings[codec.KINDS[kind]] += 1
        self.sent_bytes += size
        self.changed += changed

    # ------------------------------------------------------------------ while it runs
    def message(self, s) -> Optional[torch.Tensor]:
        return self.messages[s.key]

    def size(self, s) -> int:
        return self.headers[s.key][1]

    def wire_bytes(self, s) -> int:
        """Bytes a network bucket's payload took on the wire."""
        if s.kind == SEND:
            msg = self.messages[s.key]
            return 0 if msg is None else msg.numel()
        return self.headers[s.key][1]

    def apply(self, s, buf: torch.Tensor) -> None:
        """Apply a received payload `buf` to the receiving part's regions."""
        kind, size, check = self.headers[s.key]
        part = s.recv
        if kind == codec.DENSE:
            part.unpack(buf)
            return
        cur = self.baselines.scratch_for(s.nbytes, self.device)
        part.pack(cur)
        if kind != codec.SAME:
            codec.decode(kind, buf, cur, granule_of(part))
        got = codec.checksum(cur)
        if got != check:
            raise DeltaMismatch(
                f"a {s.nbytes}-byte bucket from process {s.peer} does not match after applying "
                f"its delta (checksum {got} != {check}): the destination shards changed outside "
                f"refits since v{self.held}; the next refit sends them dense")
        if kind != codec.SAME:
            part.unpack(cur)

    def stats(self) -> dict:
        return {"network_bytes": self.sent_bytes, "dense_network_bytes": self.dense_bytes,
                "granules": self.granules, "changed_granules": self.changed,
                "encodings": dict(self.encodings),
                "fallbacks": list(self.fallbacks),
                "baseline_bytes": self.baselines.nbytes, "clock": self.clock}


def summarize(per: list) -> Optional[dict]:
    """A delta refit's figures from every process's: network bytes sent (payloads) and what a
    dense refit sends, granules compared and found changed, buckets per encoding, the
    sender->receiver pairs sent dense and why, and the largest baseline memory of a process."""
    parts = [st["delta"] for st in per if "delta" in st]
    if not parts:
        return None
    out = {k: sum(d[k] for d in parts) for k in
           ("network_bytes", "dense_network_bytes", "granules", "changed_granules")}
    out["encodings"] = {k: sum(d["encodings"][k] for d in parts) for k in parts[0]["encodings"]}
    out["fallbacks"] = [f for d in parts for f in d["fallbacks"]]
    out["baseline_bytes"] = max(d["baseline_bytes"] for d in parts)
    return out
