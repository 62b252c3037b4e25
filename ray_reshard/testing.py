"""Test helpers: a local multi-node Ray cluster and a plain actor that holds tensors."""
from __future__ import annotations

import ray
import torch
from ray.cluster_utils import Cluster


def start_cluster(nodes: int = 2) -> Cluster:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1,
                                                            "resources": {"node0": 100}})
    for i in range(1, nodes):
        cluster.add_node(num_cpus=1, resources={f"node{i}": 100})
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    return cluster


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
