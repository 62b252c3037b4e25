"""A delta refit's predicted time: the dense replay with every network bucket's payload, copies
and codec work as a delta refit of a given changed fraction has them (`delta_messages` states
the model), and one version exchange more per refit. Every prediction comes with its
assumptions (`ASSUMPTIONS`).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..execution.delta import (CHUNK, DENSE, KINDS, MOSTLY_CHANGED, SAME, expected_encoding,
                               granule, probe_from)
from ..planning.plan import Plan
from ..planning.moves import NETWORK
from .cluster import Cluster
from .engine import replay
from .messages import FORWARD_ORDER, PATH_CODE, Messages

DELTA_CONSTANTS = ("delta_encode_Bps", "delta_decode_Bps")
ASSUMPTIONS = (
    "a prediction, not a measurement",
    "every network bucket has the given fraction of its elements (granules) changed since the "
    "previous delta refit: changes spread evenly over buckets",
    "the codec costs delta_encode_Bps / delta_decode_Bps per bucket byte at each end (see "
    "the constants' provenance), besides packing and unpacking where regions are strided",
    "sources hold the wire dtype (a conversion packs first; not modelled)",
    "this is a delta refit after another of the same spec set (the first one, and one after "
    "a failed refit, update() or a dense refit in between, travels dense)",
)


def delta_messages(msgs: Messages, fraction: float, host: bool) -> tuple[Messages, dict]:
    """`msgs` as a delta refit with `fraction` of the elements changed runs them, and the
    network figures: {"network_bytes", "dense_network_bytes", "encodings"}. `host`: the host
    codec's (CPU clusters) rules, else the GPU's.

    Per network bucket of `nbytes` (granule: the smallest element size of its items), with
    `fraction` of its granules changed since the previous delta refit, the wire carries
    `execution.delta.expected_encoding(nbytes, granule, fraction)`'s payload (the smallest of same,
    mask, index and dense). Two codecs, as the runtime has them:

    * host (CPU clusters, the compiled kernel): a sender whose regions of the bucket are all
      contiguous encodes straight from them (no packing; else it packs first) at
      `delta_encode_Bps`, the baseline kept in the same pass. A bucket with more than
      `MOSTLY_CHANGED` of its granules changed is compared only over its first eighth or first
      `MOSTLY_AFTER_CHUNKS` chunks (whole chunks), the rest copied into the baseline. A receiver
      whose regions are all contiguous applies a mask or index payload straight into them with
      the checksum at `delta_decode_Bps` (else it packs its regions first and unpacks after); a
      same bucket is checksummed (at `delta_decode_Bps` too);
    * torch (GPU clusters): the sender packs the bucket and compares it whole; a dense result is
      copied into the baseline; a receiver packs, decodes or checksums, and unpacks.

    A mask or index payload travels as one message; a dense bucket travels as a dense refit sends
    it (items in place where they are their own messages) from its baseline (no packing), a same
    one not at all. Each process exchanges one small message more before its program (versions):
    one `latency_s` on top of the refit's overhead. Per network group the sender encodes its
    buckets just before posting them, while its earlier groups are on the wire (the replay's
    order); a receiver posts its payloads once the group's headers arrived (one `latency_s` after
    its senders posted), after posting a group applies what it received in earlier groups, and
    checks the same buckets at the end of its program.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"changed fraction must be in [0, 1], got {fraction}")
    if msgs.itemsize is None:
        raise ValueError("these messages carry no item sizes (build them with messages_exact "
                         "or messages_aggregate)")
    net = (msgs.path == PATH_CODE[NETWORK]) & (msgs.order != FORWARD_ORDER)
    nbytes = msgs.nbytes.copy()
    ss, cs = msgs.strided_send.copy(), msgs.contig_send.copy()
    sr, cr = msgs.strided_recv.copy(), msgs.contig_recv.copy()
    per_item = msgs.per_item.copy()
    encode = np.zeros(len(nbytes), dtype=np.int64)
    decode = np.zeros(len(nbytes), dtype=np.int64)
    kinds = {name: 0 for name in KINDS.values()}
    dense_total = 0
    for i in np.flatnonzero(net).tolist():
        full = int(msgs.nbytes[i])
        g = granule(full, int(msgs.itemsize[i]))
        n = full // g
        kind, size = expected_encoding(full, g, fraction)
        scan = full
        if host and fraction > MOSTLY_CHANGED:
            first = -(-probe_from(n) // CHUNK) * CHUNK     # the first check, whole chunks
            if first <= n:                                  # found mostly changed there
                kind, size, scan = DENSE, full, first * g
        kinds[KINDS[kind]] += 1
        dense_total += full
        nbytes[i] = size
        encode[i] = scan
        # the sender: compare in place (host, contiguous regions) or pack first; the
        # baseline keeps the new bytes in the same pass, except the rest of a bucket found
        # mostly changed (host) and, on GPUs, whatever changed (a copy)
        if not (host and msgs.strided_send[i] == 0):
            cs[i] = full - ss[i]
        else:
            ss[i] = cs[i] = 0
        cs[i] += (full - scan) if host else (full if kind != SAME else 0)
        if kind == DENSE:               # sent from the baseline, received as a dense refit
            continue
        per_item[i] = False             # one message
        decode[i] = full
        if host and msgs.strided_recv[i] == 0:          # applied in place, with the checksum
            sr[i] = cr[i] = 0
        elif kind == SAME:                              # packed and checksummed
            cr[i] = full - sr[i]
        else:                                           # packed, decoded, unpacked
            sr[i], cr[i] = 2 * sr[i], 2 * (full - sr[i])
    out = replace(msgs, nbytes=nbytes, strided_send=ss, contig_send=cs, strided_recv=sr,
                  contig_recv=cr, per_item=per_item, encode_bytes=encode, decode_bytes=decode)
    return out, {"network_bytes": int(nbytes[net].sum()), "dense_network_bytes": dense_total,
                 "encodings": kinds}


def simulate_delta(plan: Plan, msgs: Messages, cluster: Cluster, bucket_bytes: int,
                   fraction: float, window=None, ring_recv: str = "runs") -> dict:
    """Predicted seconds and network bytes of a delta refit of `plan` (its dense `msgs`) with
    `fraction` of the elements changed since the previous delta refit."""
    host = cluster.per_item_min_bytes is not None               # the CPU wire format
    dmsgs, figures = delta_messages(msgs, fraction, host)
    cl = cluster.with_(refit_overhead_s=cluster.refit_overhead_s + cluster.latency_s)
    res = replay(plan, dmsgs, cl, bucket_bytes, None, window, ring_recv)
    return {"changed_fraction": fraction, "predicted_s": res.predicted_s,
            "bound_s": res.bound_s, "cpu_s": res.cpu_s, **figures}
