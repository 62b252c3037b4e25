"""Test helpers: a local multi-node Ray cluster and a plain actor that holds tensors."""
from __future__ import annotations

import atexit
import contextlib
import os
from typing import Optional

import ray
from ray.cluster_utils import Cluster


_SHARED: dict = {}


def start_cluster(nodes: int = 2, shared: bool = True, store_bytes: Optional[int] = None):
    """A local cluster of `nodes` simulated nodes (resource "node<i>" marks node i), connected;
    `store_bytes` of object store per node (Ray's default when None; only without `shared`).

    With `shared`, one cluster per process is started once and lent out: `shutdown()` on the
    returned handle only disconnects this driver (which ends the job and its actors), and the
    next caller reconnects in about a second instead of starting a cluster anew. The cluster
    goes at interpreter exit (`shutdown_shared`).
    """
    if not shared:
        cluster = _new_cluster(nodes, store_bytes)
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        return cluster
    if nodes not in _SHARED:
        if not _SHARED:
            atexit.register(shutdown_shared)
        _SHARED[nodes] = _new_cluster(nodes)
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address=_SHARED[nodes].address, include_dashboard=False, log_to_driver=False)
    return _Lent(_SHARED[nodes])


@contextlib.contextmanager
def local_cluster(nodes: int = 2, store_bytes: Optional[int] = None):
    """A private local cluster for a script (demo, benchmarks), `store_bytes` of object store
    per node (Ray's default when None); stopped on exit.

    With RAY_RESHARD_CLUSTER_ADDRESS set (tests running many scripts), the script joins that
    cluster of `start_cluster` instead, and leaves it running.
    """
    address = os.environ.get("RAY_RESHARD_CLUSTER_ADDRESS")
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        try:
            yield None
        finally:
            ray.shutdown()
        return
    cluster = start_cluster(nodes, shared=False, store_bytes=store_bytes)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@contextlib.contextmanager
def connect(address=None, nodes: int = 2):
    """A running cluster at `address` (its nodes marked with resources "node0", "node1", ...),
    or, without an address, a private local cluster of `nodes` nodes for this run."""
    if address is None:
        with local_cluster(nodes):
            yield
        return
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def shutdown_shared() -> None:
    """Stop the clusters `start_cluster` lent out."""
    if ray.is_initialized():
        ray.shutdown()
    while _SHARED:
        _SHARED.popitem()[1].shutdown()


def _new_cluster(nodes: int, store_bytes: Optional[int] = None) -> Cluster:
    store = {} if store_bytes is None else {"object_store_memory": store_bytes}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1,
                                                            "resources": {"node0": 100}, **store})
    for i in range(1, nodes):
        cluster.add_node(num_cpus=1, resources={f"node{i}": 100}, **store)
    return cluster


class _Lent:
    """A shared cluster as handed to one user: shutdown() leaves it running."""

    def __init__(self, cluster: Cluster):
        self._cluster = cluster

    def __getattr__(self, name):
        return getattr(self._cluster, name)

    def shutdown(self) -> None:
        if ray.is_initialized():
            ray.shutdown()


@ray.remote(num_cpus=0)
class Holder:
    """A user actor that knows nothing of ray-reshard: it just holds tensors."""

    def __init__(self):
        self.tensors = {}

    def set(self, tensors):
        self.tensors = {k: v.clone() for k, v in tensors.items()}

    def get(self):
        return self.tensors

    def reshard_tensors(self):
        return self.tensors

    def node(self):
        return ray.get_runtime_context().get_node_id()


def holders(n: int, node: int) -> list:
    return [Holder.options(resources={f"node{node}": 1}).remote() for _ in range(n)]
