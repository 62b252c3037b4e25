"""Cluster simulator: replays a refit plan's schedule on a described cluster (pure: no Ray).

    from ray_reshard.sim import simulate, gather_broadcast_seconds, preset
    res = simulate(plan, preset("dgx-h100"))        # bucket_bytes: the library's default
    res.predicted_s, res.bound_s

CLI: `ray-reshard simulate --model ... --train ... --infer ... --cluster ...` (`tools/simulate.py`).
"""
from .cluster import GB, MEASURED_ITEM_S, PRESETS, Cluster, preset
from .engine import SimResult, replay, simulate
from .gather_broadcast import gather_broadcast_seconds
from .messages import Messages, messages_aggregate, messages_exact

__all__ = ["Cluster", "GB", "MEASURED_ITEM_S", "Messages", "PRESETS", "SimResult",
           "gather_broadcast_seconds", "messages_aggregate", "messages_exact", "preset", "replay",
           "simulate"]
