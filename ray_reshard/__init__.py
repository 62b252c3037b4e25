"""ray-reshard: move model weights between differently sharded sets of Ray actors.

Layouts (`ray_reshard.layout`), planning (`ray_reshard.planning`) and execution in one
process (`ray_reshard.execution`) import no Ray; the runtime (`ReshardGroup`), the model
recipes (`ray_reshard.models`) and the session helpers (`connect`, `on_node`) load on first use.
"""
from .layout import (BlockFP8, Box, Layout, LayoutUnion, Mesh, Replicate, Shard, Slot, TensorSpec,
                     assemble, combine_destinations, replica_specs, shard_tensor)
from .planning import (DEFAULT_BUCKET_BYTES, Endpoint, Move, Plan, PlanError, PlanStats, Topology,
                       plan)
from .errors import RefitError, TransportError, TransportTimeout

__version__ = "0.1.0"

_LAZY = {"ReshardGroup": "runtime.group", "RefitResult": "runtime.result",
         "PendingRefit": "runtime.group", "models": "models",
         "connect": "session", "on_node": "session", "ClusterUnreachable": "session"}

__all__ = ["BlockFP8", "Box", "ClusterUnreachable", "DEFAULT_BUCKET_BYTES", "Endpoint", "Layout",
           "LayoutUnion", "Mesh", "Move", "PendingRefit", "Plan", "PlanError", "PlanStats",
           "RefitError", "RefitResult", "Replicate", "ReshardGroup", "Shard", "Slot",
           "TensorSpec", "Topology", "TransportError", "TransportTimeout", "assemble",
           "combine_destinations", "connect", "models", "on_node", "plan", "replica_specs",
           "shard_tensor"]


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def __getattr__(name):
    if name in _LAZY:
        import importlib
        mod = importlib.import_module(f".{_LAZY[name]}", __name__)
        return mod if name == "models" else getattr(mod, name)
    raise AttributeError(f"module 'ray_reshard' has no attribute {name!r}")
