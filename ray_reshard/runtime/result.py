"""RefitResult: what one refit did (bytes by path, time, staging, the plan's statistics)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..planning.plan import PlanStats
from . import metrics


@dataclass
class RefitResult:
    """What one refit did. Bytes are destination-dtype bytes."""

    version: int
    seconds: float
    strategy: str
    bytes_by_path: dict            # bytes moved: network / domain / local
    network_gbps: float            # network bytes / seconds
    peak_staging_bytes: int        # the largest staging memory any rank held
    extra_bytes: int               # the largest atomic/snapshot/aliasing copy any rank held
    plan_stats: PlanStats
    planned: bool                  # False when the plan came from the cache
    per_process: list = field(default_factory=list)
    # Things that did not stop the refit but need attention (e.g. a source process that died
    # after its data moved: the group needs update() before the next refit).
    warnings: list = field(default_factory=list)
    # A delta refit's figures (see `delta.summarize`), None for a dense one.
    delta: Optional[dict] = None

    def summary(self) -> str:
        b = self.bytes_by_path
        if b["network"]:
            rate = f"network {self.network_gbps:.2f} GB/s"
        else:                   # one domain: what moved went over shared memory or copies
            moved = sum(b.values())
            rate = (f"no network bytes (one domain), "
                    f"{moved / self.seconds / 1e9 if self.seconds > 0 else 0.0:.2f} GB/s moved")
        return (f"refit v{self.version} [{self.strategy}] {self.seconds:.3f} s: "
                f"network {b['network'] / 1e6:.1f} MB (bound {self.plan_stats.min_network_bytes / 1e6:.1f} MB), "
                f"domain {b['domain'] / 1e6:.1f} MB, local {b['local'] / 1e6:.1f} MB, "
                f"{rate}, peak staging {self.peak_staging_bytes / 1e6:.1f} MB/rank")

    def to_dict(self) -> dict:
        """Flat figures for experiment trackers (see `metrics.refit_dict`)."""
        return metrics.refit_dict(self)

    def to_arrow(self):
        """`to_dict()` as a one-row pyarrow Table."""
        return metrics.to_arrow(self.to_dict())
