"""Refit observability: Ray metrics and one log line per refit.

`observe_refit` wraps `ReshardGroup.refit`. After each refit that completes it logs one INFO line
on the ``ray_reshard`` logger (version, seconds, GB by path, network GB/s) and records, through
`ray.util.metrics` (so they reach the Ray dashboard and Prometheus through each node's metrics
agent, with Ray's ``ray_`` prefix):

    ray_reshard_refit_seconds        histogram, tag strategy
    ray_reshard_refit_bytes_total    counter, tags strategy, path (network / domain / local)
    ray_reshard_refits_total         counter, tag strategy
    ray_reshard_refit_failures_total counter, tag kind (the exception class: RefitError,
                                     ValueError for input refused before any byte moved, ...)

A refit that raises is counted as a failure and the exception propagates unchanged. Recording
never fails a refit: a metrics error is logged at DEBUG and dropped.

`refit_dict` / `to_arrow` turn a RefitResult into flat figures for experiment trackers.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Optional

log = logging.getLogger("ray_reshard")

SECONDS_BOUNDARIES = [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0]
PATHS = ("network", "domain", "local")

_METRICS: Optional[dict] = None


def _metrics() -> dict:
    global _METRICS
    if _METRICS is None:
        from ray.util.metrics import Counter, Histogram

        _METRICS = {
            "seconds": Histogram("reshard_refit_seconds", "Wall time of one refit (seconds)",
                                 boundaries=SECONDS_BOUNDARIES, tag_keys=("strategy",)),
            "bytes": Counter("reshard_refit_bytes", "Bytes moved by refits, by path",
                             tag_keys=("strategy", "path")),
            "refits": Counter("reshard_refits", "Refits completed", tag_keys=("strategy",)),
            "failures": Counter("reshard_refit_failures", "Refits that raised, by exception kind",
                                tag_keys=("kind",)),
        }
    return _METRICS


def log_line(result) -> str:
    """`refit v12 [reshard] 1.234 s: network 10.000 GB, domain 2.000 GB, local 0.000 GB,
    8.10 GB/s`."""
    b = result.bytes_by_path
    return (f"refit v{result.version} [{result.strategy}] {result.seconds:.3f} s: "
            + ", ".join(f"{p} {b.get(p, 0) / 1e9:.3f} GB" for p in PATHS)
            + f", {result.network_gbps:.2f} GB/s")


def record_refit(result) -> None:
    """Log and export one completed refit."""
    log.info(log_line(result))
    try:
        m = _metrics()
        tags = {"strategy": result.strategy}
        m["seconds"].observe(result.seconds, tags=tags)
        m["refits"].inc(1.0, tags=tags)
        for path in PATHS:
            n = result.bytes_by_path.get(path, 0)
            if n:
                m["bytes"].inc(float(n), tags={"strategy": result.strategy, "path": path})
    except Exception:                      # never fail a refit over its metrics
        log.debug("recording refit metrics failed", exc_info=True)


def record_failure(error: BaseException) -> None:
    """Count one refit that raised, by the exception's class name."""
    kind = type(error).__name__
    log.info(f"refit failed ({kind}): {(str(error).splitlines() or [''])[0]}")
    try:
        _metrics()["failures"].inc(1.0, tags={"kind": kind})
    except Exception:
        log.debug("recording refit failure failed", exc_info=True)


def observe_refit(fn):
    """Decorator for `ReshardGroup.refit`: record each result or failure (see module doc)."""
    @functools.wraps(fn)
    def refit(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
        except Exception as e:
            record_failure(e)
            raise
        record_refit(result)
        return result
    return refit


# ---------------------------------------------------------------- flat figures
def refit_dict(result) -> dict[str, Any]:
    """A RefitResult as flat figures: bytes per path as `<path>_bytes`, plan statistics as
    `plan_<field>`, a delta refit's figures as `delta_<field>` (its fallbacks counted);
    per-process figures are left out (see `result.per_process`)."""
    out: dict[str, Any] = {
        "version": result.version, "seconds": result.seconds, "strategy": result.strategy,
        **{f"{p}_bytes": int(result.bytes_by_path.get(p, 0)) for p in PATHS},
        "network_gbps": result.network_gbps, "peak_staging_bytes": result.peak_staging_bytes,
        "extra_bytes": result.extra_bytes, "planned": result.planned,
        "warnings": [str(w) for w in getattr(result, "warnings", ())],
    }
    out.update({f"plan_{k}": v for k, v in dataclasses.asdict(result.plan_stats).items()})
    delta = getattr(result, "delta", None)
    if delta:
        for k, v in delta.items():
            if k == "encodings":
                out.update({f"delta_{e}_buckets": n for e, n in v.items()})
            elif k == "fallbacks":
                out["delta_fallbacks"] = len(v)
            else:
                out[f"delta_{k}"] = v
    return out


def to_arrow(row: dict):
    """One row as a pyarrow Table (append rows of many refits with `pyarrow.concat_tables`)."""
    import pyarrow as pa

    return pa.Table.from_pylist([row])
