"""What is where (no Ray): meshes, placements, boxes, layouts, tensor specs and their storage
slots, block-FP8 formats, and spec sets built from them (replica fill, several destination
groups)."""
from .box import Box
from .destinations import combine_destinations
from .layout import Layout, LayoutUnion
from .mesh import Mesh
from .placement import Placement, Replicate, Shard, as_placement
from .quant import BlockFP8
from .replica import replica_specs
from .slicing import assemble, shard_tensor
from .slots import Slot, Slots
from .spec import TensorSpec
