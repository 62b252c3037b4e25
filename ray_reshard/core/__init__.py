"""The pure core: layouts, the planner and plan statistics. Imports no Ray."""
from .box import Box
from .destinations import combine_destinations
from .layout import Layout, LayoutUnion
from .mesh import Mesh
from .placement import Placement, Replicate, Shard, as_placement
from .plan import DEFAULT_BUCKET_BYTES, Item, Plan, PlanStats, Schedule, Transfer, plan
from .planner import DOMAIN, LOCAL, NETWORK, Endpoint, Move, PlanError, TensorPlan, Topology
from .quant import BlockFP8
from .replica import replica_specs
from .slicing import assemble, shard_tensor
from .spec import Slot, Slots, TensorSpec
