"""A cluster in a box: real Ray nodes in Linux network namespaces, joined by a bridge through
links shaped with `tc`, for tests and benchmarks whose network must be slower than memory.

    with NetnsCluster(nodes=3, rate="1gbit") as box:      # root, `ip` and `tc` needed
        driver = box.driver()                              # a process in the head's namespace
        result = driver.call("my_package.refits:one_refit", tensors=32)   # JSON in and out
        box.links.partition(2)                             # node 2 cut off from the head

Each node is a `ray start` in its own namespace; node i carries the resource "node<i>" (what
`ray_reshard.on_node` places by). The driver must run inside the head's namespace: `driver()`
starts a Python process there that calls functions by name and returns their JSON results.
Everything the box makes carries the prefix "rrbox-" and lives inside its own namespaces (the
bridge too): no interface or address of the host is touched. `close()` ends every process of
the namespaces and deletes them; a box whose owner died is removed by the next one that starts
(or by `python -m ray_reshard.tools.netns_cluster clean`). See docs/shaped-cluster.md.
"""
from .box import NetnsCluster, clean_leftovers, leftovers
from .driver import Driver, DriverError, PendingCall
from .links import Links, links, node_indices
from .spec import NODE_IF, PREFIX, rate_bytes_per_s, unavailable

__all__ = ["NetnsCluster", "Links", "Driver", "DriverError", "PendingCall", "unavailable",
           "links", "node_indices", "rate_bytes_per_s", "clean_leftovers", "leftovers",
           "NODE_IF", "PREFIX"]
