"""Ray sessions for scripts: join the caller's, join a cluster by address, or start a local one.

    with rr.connect(args.address):                       # None: a local two-node cluster
        trainers = [Trainer.options(**rr.on_node(0)).remote() for _ in range(4)]
        engines = [Engine.options(**rr.on_node(1)).remote() for _ in range(4)]

`connect` reuses a Ray session the caller already started (and leaves it running), connects to
`address` when one is given (failing within seconds when nothing answers there), and otherwise
starts a local cluster of simulated nodes on this machine, stopped on exit. `on_node(i)` gives
the actor options that place an actor on the i-th node, so trainers and engines land in
different domains whichever of the three it is.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Iterator, Optional
from urllib.parse import urlsplit

__all__ = ["connect", "on_node", "ClusterUnreachable"]


class ClusterUnreachable(ConnectionError):
    """Nothing answers at the Ray address given."""


def _host_port(address: str) -> Optional[tuple[str, int]]:
    """`host:port` or `ray://host:port` -> (host, port); None for `auto`, `local` and the like."""
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname or port is None:
        return None
    return parts.hostname, port


def _check_reachable(address: str, timeout_s: float) -> None:
    target = _host_port(address)
    if target is None:
        return
    try:
        with socket.create_connection(target, timeout=timeout_s):
            pass
    except OSError as e:
        raise ClusterUnreachable(
            f"no Ray cluster answers at {address!r} ({e.strerror or e}); start one with "
            f"`ray start --head` and pass its address, or omit the address to start a local "
            f"cluster") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_within(address: str, timeout_s: float) -> None:
    """`ray.init(address)`, giving up after about `timeout_s` when what answers there is not a
    Ray cluster (Ray itself retries for about 20 s; its GCS wait can be shortened by setting
    RAY_gcs_server_port_wait_time_s for the call)."""
    import ray

    key = "RAY_gcs_server_port_wait_time_s"
    before = os.environ.get(key)
    os.environ.setdefault(key, str(max(1, int(timeout_s))))
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ClusterUnreachable(f"cannot join a Ray cluster at {address!r}: {first}") from None
    finally:
        if before is None:
            os.environ.pop(key, None)


@contextlib.contextmanager
def connect(address: Optional[str] = None, *, nodes: int = 2,
            timeout_s: float = 5.0) -> Iterator[None]:
    """A Ray session for the `with` block.

    - Ray already initialised in this process: that session is used and left running.
    - `address` given (`host:port`, `ray://host:port`, `auto`): `ray.init(address=address)`,
      disconnected on exit; `ClusterUnreachable` within `timeout_s` when nothing listens there.
    - Neither: a local cluster of `nodes` simulated nodes on this machine (node i carries the
      custom resource `node<i>`, which `on_node` uses), stopped on exit.
    """
    import ray

    if ray.is_initialized():
        yield
        return
    if address is not None:
        _check_reachable(address, timeout_s)
        _init_within(address, timeout_s)
        try:
            yield
        finally:
            ray.shutdown()
        return
    if nodes < 1:
        raise ValueError(f"nodes must be at least 1, got {nodes}")
    from ray.cluster_utils import Cluster

    ray_logger = logging.getLogger("ray")
    level = ray_logger.level
    ray_logger.setLevel(logging.WARNING)         # Ray's INFO lines about starting nodes
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": {"node0": 100}, "include_dashboard": False,
            "dashboard_port": _free_port()})     # its API server starts even so
        for i in range(1, nodes):
            cluster.add_node(num_cpus=1, resources={f"node{i}": 100})
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
        yield
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        ray_logger.setLevel(level)


def on_node(i: int) -> dict:
    """Actor options (`Actor.options(**on_node(i))`) that place an actor on node `i`.

    The node is the one marked with the custom resource `node<i>` where the cluster has it (the
    local clusters `connect` starts do); otherwise the i-th alive node in Ray's node list, by
    node affinity; on a one-node cluster, that node (no options).
    """
    import ray

    if i < 0:
        raise ValueError(f"node index must be >= 0, got {i}")
    if ray.cluster_resources().get(f"node{i}", 0) >= 1:
        return {"resources": {f"node{i}": 1}}
    alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    if len(alive) < 2:
        return {}
    if i >= len(alive):
        raise ValueError(f"node {i} asked for, but the cluster has {len(alive)} nodes")
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(alive[i], soft=False)}
