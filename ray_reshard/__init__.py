"""ray-reshard: move model weights between differently sharded sets of Ray actors."""
from .core import (Box, DEFAULT_BUCKET_BYTES, Endpoint, Layout, Mesh, Move, Plan, PlanError,
                   PlanStats, Replicate, Shard, Slot, TensorSpec, Topology, assemble, plan,
                   shard_tensor)

__version__ = "0.1.0"
