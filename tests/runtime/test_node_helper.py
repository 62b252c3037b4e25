"""NodeHelper on a simulated two-node Ray cluster (head + one worker node on this machine)."""
from __future__ import annotations

import os
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from ray_reshard.errors import TransportError
from ray_reshard.runtime.node_helper import (DOMAIN_ENV, NodeHelper, discover_actor_info,
                                             start_node_helpers)
from ray_reshard.runtime.transport.cuda_ipc import CudaIpcRing
from ray_reshard.runtime.transport.segment import SHM_DIR, segment_exists
from ray_reshard.runtime.transport.shm import ShmRing

T = 60


@pytest.fixture(scope="module")
def cluster():
    """Head + one worker node (both on this machine); yields their node ids, sorted."""
    c = Cluster()
    try:
        c.add_node(num_cpus=2, object_store_memory=80 * 1024 ** 2, include_dashboard=False)
        c.add_node(num_cpus=2, object_store_memory=80 * 1024 ** 2)
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        assert len(nodes) == 2
        yield nodes
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def helpers(cluster):
    """One helper per node; the head node's helper simulates a separate NVLink domain through
    RAY_RESHARD_DOMAIN (set with domains=, merged into the helper's runtime_env)."""
    hs = start_node_helpers(cluster, name_prefix="rr-test-helper",
                            domains={cluster[0]: "rack-0"},
                            runtime_env={"env_vars": {"RR_TEST_UNRELATED": "1"}})
    yield hs
    for h in hs.values():
        ray.kill(h)


def _gone(names):
    return [n for n in names if segment_exists(n)]


def test_one_helper_per_node_lands_on_its_node(cluster, helpers):
    assert set(helpers) == set(cluster)
    pings = ray.get([helpers[n].ping.remote() for n in cluster], timeout=T)
    assert pings == cluster
    topos = ray.get([helpers[n].topology.remote() for n in cluster], timeout=T)
    for n, t in zip(cluster, topos):
        assert t["node_id"] == n
        assert t["hostname"] and t["ip"]
        assert isinstance(t["gpus"], list)
        for g in t["gpus"]:
            assert set(g) == {"index", "uuid", "domain"}
            assert g["domain"] == t["domain"]
    # no NVLink fabric here: a node is its own domain unless RAY_RESHARD_DOMAIN says otherwise
    assert topos[1]["domain"] == cluster[1]


def test_named_helpers_are_reused(cluster, helpers):
    again = start_node_helpers(cluster, name_prefix="rr-test-helper")
    for n in cluster:
        assert again[n]._actor_id == helpers[n]._actor_id


def test_domain_override(cluster, helpers):
    t = ray.get(helpers[cluster[0]].topology.remote(), timeout=T)
    assert t["domain"] == "rack-0" and t["node_id"] == cluster[0]
    env = ray.get(helpers[cluster[0]].__ray_call__.remote(
        lambda self: (os.environ.get(DOMAIN_ENV), os.environ.get("RR_TEST_UNRELATED"))),
        timeout=T)
    assert env == ("rack-0", "1")          # domains= merged into the given runtime_env
    env = ray.get(helpers[cluster[1]].__ray_call__.remote(
        lambda self: (os.environ.get(DOMAIN_ENV), os.environ.get("RR_TEST_UNRELATED"))),
        timeout=T)
    assert env == (None, "1")


def test_rings_created_sealed_destroyed_leave_dev_shm_clean(cluster, helpers):
    h = helpers[cluster[1]]
    names = ray.get(h.create_rings.remote("g1", 3, 1 << 16, 2), timeout=T)
    assert len(set(names)) == 3
    for n in names:
        st = os.stat(os.path.join(SHM_DIR, n))
        assert st.st_mode & 0o777 == 0o600
    assert sorted(ray.get(h.segments.remote(), timeout=T)) == sorted(names)
    assert sorted(ray.get(h.segments.remote("g1"), timeout=T)) == sorted(names)
    # both ends attach (here: the driver, twice), then the helper seals
    ends = [(ShmRing.attach(n), ShmRing.attach(n)) for n in names]
    ray.get(h.seal.remote("g1"), timeout=T)
    assert _gone(names) == []
    assert ray.get(h.segments.remote(), timeout=T) == []
    for tx, rx in ends:                         # the mappings still work
        tx.send_slot(5, time.monotonic() + 5).fill_(42)
        tx.commit_send()
        assert rx.recv_slot(time.monotonic() + 5).tolist() == [42] * 5
        rx.release_recv()
    with pytest.raises(TransportError):
        ShmRing.attach(names[0])
    ray.get(h.destroy_group.remote("g1"), timeout=T)
    ray.get(h.destroy_group.remote("g1"), timeout=T)   # idempotent
    assert "g1" not in ray.get(h.groups.remote(), timeout=T)
    for tx, rx in ends:
        tx.close()
        rx.close()

    # destroy without seal unlinks too
    names2 = ray.get(h.create_rings.remote("g2", 2, 4096), timeout=T)
    names3 = ray.get(h.create_rings.remote("g3", 1, 4096), timeout=T)
    assert _gone(names2 + names3) == names2 + names3
    ray.get(h.destroy_group.remote("g2"), timeout=T)
    assert _gone(names2) == []
    assert ray.get(h.segments.remote(), timeout=T) == names3
    ray.get(h.destroy_group.remote("g3"), timeout=T)
    assert _gone(names3) == []

    # GPU rings: header-only segments (the receiver allocates the slots on its GPU)
    gnames = ray.get(h.create_rings.remote("g4", 2, 256 << 20, 2, gpu=True), timeout=T)
    for n in gnames:
        assert os.stat(os.path.join(SHM_DIR, n)).st_size < (1 << 20)
        r = CudaIpcRing.attach(n)
        assert (r.slot_bytes, r.slots) == (256 << 20, 2)
        r.close()
        with pytest.raises(TransportError):
            ShmRing.attach(n)                   # no CPU slots in there
    ray.get(h.destroy_group.remote("g4"), timeout=T)
    assert _gone(gnames) == []


def test_discover_actor_info_inside_actor(cluster, helpers):
    # any actor will do: ask the helpers themselves
    infos = ray.get([helpers[n].__ray_call__.remote(lambda self: discover_actor_info())
                     for n in cluster], timeout=T)
    for node, info in zip(cluster, infos):
        assert info["node_id"] == node
        assert info["device"] == "cpu" and info["gpu_uuid"] is None and info["gpu_ids"] == []
        assert info["pid"] != os.getpid()
    assert infos[0]["pid"] != infos[1]["pid"]


def test_helpers_take_no_cpu(cluster, helpers):
    ray.get([h.ping.remote() for h in helpers.values()], timeout=T)
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 4


def test_node_helper_class_options():
    assert isinstance(NodeHelper, ray.actor.ActorClass)


def test_killed_helper_leaves_nothing_and_graceful_exit_unlinks(cluster, helpers):
    # Runs last (it ends the module's helpers). One helper is killed (SIGKILL: no finalizer runs)
    # holding a sealed group and an unsealed one: the sealed names are gone already, its reaper
    # process unlinks the unsealed ones. The other exits gracefully with unsealed rings: its
    # finalizer unlinks them.
    killed, graceful = helpers[cluster[1]], helpers[cluster[0]]
    assert ray.get([killed.reaper_alive.remote(), graceful.reaper_alive.remote()], timeout=T) \
        == [True, True]
    names = ray.get(killed.create_rings.remote("g", 4, 1 << 20), timeout=T)
    left = ray.get(killed.create_rings.remote("unsealed", 2, 4096), timeout=T)
    unsealed = ray.get(graceful.create_rings.remote("g", 2, 4096), timeout=T)
    ends = [ShmRing.attach(n) for n in names]
    ray.get(killed.seal.remote("g"), timeout=T)
    assert _gone(names) == [] and _gone(left) == left
    ray.kill(killed)
    # ray.kill is asynchronous: a call sent right after may still be served before it lands.
    with pytest.raises(ray.exceptions.RayActorError):
        deadline = time.monotonic() + T
        while time.monotonic() < deadline:
            ray.get(killed.ping.remote(), timeout=T)
            time.sleep(0.1)
    ends[0].send_slot(1, time.monotonic() + 5).fill_(1)   # the memory lives with its mappings
    ends[0].commit_send()
    for r in ends:
        r.close()

    assert _gone(unsealed) == unsealed
    graceful.__ray_terminate__.remote()
    deadline = time.monotonic() + 30
    while (_gone(unsealed) or _gone(left)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(unsealed) == []
    assert _gone(left) == []
    assert _gone(names) == []
