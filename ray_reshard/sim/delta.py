"""A delta refit's predicted time: the dense replay with every network bucket's payload, copies
and codec work as a delta refit of a given changed fraction has them.

Per network bucket of `nbytes` (granule: the smallest element size of its items), with
`fraction` of its granules changed since the previous delta refit:

* the wire carries `execution.delta.expected_encoding(nbytes, granule, fraction)`'s payload
  (the smallest of same, mask, index and dense), posted as one message (nothing travels in place);
* the sender packs the whole bucket, compares it with its baseline and encodes it
  (`delta_encode_Bps`; on a CPU cluster, where more than `MOSTLY_CHANGED` of the elements
  changed, only the first eighth or first `MOSTLY_AFTER_CHUNKS` chunks, whole chunks: the
  encoder sends such a bucket dense without comparing the rest);
  the packed bytes become its baseline (buffers swapped, no copy);
* the receiver of a mask or index payload packs its destination regions (the baseline's
  bytes), decodes and checksums (`delta_decode_Bps`) and unpacks; of a dense one it unpacks;
  of a same one it packs and checksums (charged at `delta_decode_Bps` too);
* each process exchanges two small messages more before its program (versions, headers):
  two `latency_s` on top of the refit's overhead.

The assumptions, returned with every prediction: changes spread evenly over buckets, the
codec's cost linear in bucket bytes at the constants' rates.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..execution.delta import (CHUNK, DENSE, KINDS, MOSTLY_AFTER_CHUNKS, MOSTLY_CHANGED, SAME,
                               expected_encoding, granule)
from ..planning.plan import Plan
from ..planning.planner import NETWORK
from .cluster import Cluster
from .engine import FORWARD_ORDER, PATH_CODE, Messages, replay

DELTA_CONSTANTS = ("delta_encode_Bps", "delta_decode_Bps")
ASSUMPTIONS = (
    "a prediction, not a measurement",
    "every network bucket has the given fraction of its elements (granules) changed since the "
    "previous delta refit: changes spread evenly over buckets",
    "the codec costs delta_encode_Bps / delta_decode_Bps per bucket byte at each end (see "
    "the constants' provenance), besides packing and unpacking",
    "this is a delta refit after another of the same spec set (the first one, and one after "
    "a failed refit, update() or a dense refit in between, travels dense)",
)


def delta_messages(msgs: Messages, fraction: float, early_exit: bool) -> tuple[Messages, dict]:
    """`msgs` as a delta refit with `fraction` of the elements changed runs them (see the
    module docstring), and the network figures: {"network_bytes", "dense_network_bytes",
    "encodings"}. `early_exit`: the CPU encoder's (it stops comparing a mostly changed
    bucket)."""
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
        kinds[KINDS[kind]] += 1
        dense_total += full
        nbytes[i] = size
        per_item[i] = False
        cs[i] = full - ss[i]                        # packed (the baseline from then on)
        scan = full
        if early_exit and fraction > MOSTLY_CHANGED:
            eighth = -(-(-(-n // 8)) // CHUNK) * CHUNK              # whole chunks
            scan = min(eighth, MOSTLY_AFTER_CHUNKS * CHUNK, n) * g
        encode[i] = scan
        if kind == DENSE:
            cr[i] = full - sr[i]
        elif kind == SAME:                          # packed and checksummed
            cr[i] = full - sr[i]
            decode[i] = full
        else:                                       # MASK or INDEX: pack, decode, unpack
            sr[i], cr[i] = 2 * sr[i], 2 * (full - sr[i])
            decode[i] = full
    out = replace(msgs, nbytes=nbytes, strided_send=ss, contig_send=cs, strided_recv=sr,
                  contig_recv=cr, per_item=per_item, encode_bytes=encode, decode_bytes=decode)
    return out, {"network_bytes": int(nbytes[net].sum()), "dense_network_bytes": dense_total,
                 "encodings": kinds}


def simulate_delta(plan: Plan, msgs: Messages, cluster: Cluster, bucket_bytes: int,
                   fraction: float, window=None, ring_recv: str = "runs") -> dict:
    """Predicted seconds and network bytes of a delta refit of `plan` (its dense `msgs`) with
    `fraction` of the elements changed since the previous delta refit."""
    early_exit = cluster.per_item_min_bytes is not None         # the CPU wire format
    dmsgs, figures = delta_messages(msgs, fraction, early_exit)
    cl = cluster.with_(refit_overhead_s=cluster.refit_overhead_s + 2 * cluster.latency_s)
    res = replay(plan, dmsgs, cl, bucket_bytes, None, window, ring_recv)
    return {"changed_fraction": fraction, "predicted_s": res.predicted_s,
            "bound_s": res.bound_s, "cpu_s": res.cpu_s, **figures}
