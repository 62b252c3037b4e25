"""ray-reshard: move model weights between differently sharded sets of Ray actors.

The core (`ray_reshard.core`: layouts, planner, statistics) imports no Ray; the runtime
(`ReshardGroup`) and the model recipes (`ray_reshard.models`) load on first use.
"""
from .core import (BlockFP8, Box, DEFAULT_BUCKET_BYTES, Endpoint, Layout, LayoutUnion, Mesh,
                   Move, Plan, PlanError, PlanStats, Replicate, Shard, Slot, TensorSpec, Topology,
                   assemble, combine_destinations, plan, replica_specs, shard_tensor)
from .errors import RefitError, TransportError, TransportTimeout

__version__ = "0.1.0"

_LAZY = {"ReshardGroup": "runtime.group", "RefitResult": "runtime.group",
         "PendingRefit": "runtime.group", "models": "models"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        mod = importlib.import_module(f".{_LAZY[name]}", __name__)
        return mod if name == "models" else getattr(mod, name)
    raise AttributeError(f"module 'ray_reshard' has no attribute {name!r}")
