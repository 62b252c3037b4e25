"""The refit protocol under pressure: program identity, concurrent callers, bounded caches,
failures after the data moved (commit), restarted actors, inference tensors, empty tensors,
and failures inside the run phase that must end the refit at once, not at the deadline."""
import os
import sys
import threading
import time

import pytest
import ray
import torch
from ray import cloudpickle

import ray_reshard as rr
from ray_reshard.runtime import worker
from ray_reshard.tools.testing import Holder

from reliability_util import L

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(240)

ROWS_L = L([0, 1], rr.Shard(0))
COLS_L = L([0, 1], rr.Shard(1))


def actors(n, node, **opts):
    return [Holder.options(resources={f"node{node}": 1}, **opts).remote() for _ in range(n)]


@pytest.fixture(scope="module")
def pair(cluster):
    """Two sources on node 0 and two destinations on node 1, shared by the tests that leave
    them healthy (starting actors costs seconds on a loaded machine)."""
    return actors(2, 0), actors(2, 1)


def spec(shape=(8, 8), src=ROWS_L, dst=COLS_L, dtype=torch.float32):
    return rr.TensorSpec(shape, dtype, src, dst)


def load(src, dst, specs, step, dst_fill=None):
    fulls = {n: torch.arange(s.numel, dtype=torch.float32).reshape(s.shape) + 1000 * step
             for n, s in specs.items()}
    ray.get([a.set.remote({n: rr.shard_tensor(fulls[n], s.src, r) for n, s in specs.items()
                           if s.src.box(r, s.shape) is not None})
             for r, a in enumerate(src)])
    ray.get([a.set.remote({n: (dst_fill or torch.zeros)(s.dst.local_shape(r, s.shape))
                           for n, s in specs.items() if s.dst.box(r, s.shape) is not None})
             for r, a in enumerate(dst)])
    return fulls


def exact(dst, specs, fulls):
    got = ray.get([a.get.remote() for a in dst])
    return all(torch.equal(got[r][n], rr.shard_tensor(fulls[n], s.dst, r))
               for n, s in specs.items() for r in range(len(dst))
               if s.dst.box(r, s.shape) is not None)


def held(actors_, group):
    return ray.get([a.__ray_call__.remote(worker.held_resources, group.group_id)
                    for a in actors_])


class CollidingName(str):
    """A tensor name whose hash collides with every other one of its kind."""

    def __hash__(self):
        return 7


def test_spec_sets_with_colliding_hashes_get_their_own_programs(pair):
    src, dst = pair
    a = {CollidingName("a"): spec()}
    b = {CollidingName("b"): spec()}
    assert hash(tuple(a.items())) == hash(tuple(b.items()))
    with rr.ReshardGroup(src, dst, timeout_s=30) as g:
        for step, specs in enumerate([a, b, a, b]):
            fulls = load(src, dst, specs, step)
            g.refit(specs)
            assert exact(dst, specs, fulls), (step, list(specs))
        assert {p["programs"] for p in held(src + dst, g)} == {2}


def test_concurrent_refits_are_serialised_with_unique_versions(pair):
    src, dst = pair
    sets = [{"x": spec()}, {"y": spec((4, 6))}]
    both = {**sets[0], **sets[1]}
    fulls = load(src, dst, both, 3)
    versions, errors = [], []
    with rr.ReshardGroup(src, dst, timeout_s=30) as g:
        def go(specs):
            try:
                for _ in range(4):
                    versions.append(g.refit(specs).version)
            except Exception as e:          # pragma: no cover - reported below
                errors.append(e)
        threads = [threading.Thread(target=go, args=(s,)) for s in sets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert sorted(versions) == list(range(1, 9))
        assert g.version == 8 and g.versions() == [8] * 4
        assert exact(dst, both, fulls)


def test_caches_are_bounded_and_evicted_rings_closed(cluster):
    """Many distinct spec sets: every actor keeps at most max_programs programs; a ring that
    only evicted programs used is closed at both ends."""
    src, dst = actors(2, 0), actors(2, 0)          # one node: shared-memory rings
    only = lambda r: L([r], rr.Replicate())
    first = {"a": spec(src=only(0), dst=only(0))}  # process 0 -> process 2 only
    later = lambda i: {f"t{i}": spec((8, 8 + i), src=only(1), dst=only(1))}   # 1 -> 3 only
    with rr.ReshardGroup(src, dst, timeout_s=30, max_programs=3) as g:
        fulls = load(src, dst, first, 0)
        g.refit(first)
        assert exact(dst, first, fulls)
        before = held(src + dst, g)
        assert list(before[0]["rings_out"]) == [2] and list(before[2]["rings_in"]) == [0]
        for i in range(5):
            fulls = load(src, dst, later(i), i)
            g.refit(later(i))
            assert exact(dst, later(i), fulls)
            assert all(p["programs"] <= 3 for p in held(src + dst, g))
        after = held(src + dst, g)
        assert after[0]["rings_out"] == {} and after[2]["rings_in"] == {}
        assert list(after[1]["rings_out"]) == [3]
        fulls = load(src, dst, first, 9)             # evicted: planned and installed again
        res = g.refit(first)
        assert res.planned and exact(dst, first, fulls)


def _die_at(fn_name):
    """Make `worker.<fn_name>` exit this process (the next call of it, from the driver)."""
    def patch(actor):
        from ray_reshard.runtime import worker as w
        setattr(w, fn_name, lambda *a, **k: os._exit(1))
    return patch


def test_source_dying_before_commit_still_completes_the_refit(cluster):
    """The data moved; only a source-only process is gone: the refit counts, with a warning,
    and the group needs update() before the next refit."""
    src, dst = actors(2, 0, max_restarts=0), actors(2, 1)
    specs = {"w": spec()}
    with rr.ReshardGroup(src, dst, timeout_s=10) as g:
        load(src, dst, specs, 0)
        g.refit(specs)
        fulls = load(src, dst, specs, 1)
        ray.get(src[1].__ray_call__.remote(_die_at("commit")))
        with pytest.warns(RuntimeWarning, match=r"src rank 1 failed after its data moved"):
            res = g.refit(specs, atomic=True)
        assert res.version == 2 and g.version == 2 and res.warnings
        assert exact(dst, specs, fulls)
        assert ray.get([a.__ray_call__.remote(worker.version, g.group_id) for a in dst]) == [2, 2]
        with pytest.raises(rr.RefitError, match="call update"):
            g.refit(specs)
        g.update(src_actors=[src[0], actors(1, 0)[0]])
        fulls = load(g.src_actors, dst, specs, 2)
        assert g.refit(specs).version == 3 and exact(dst, specs, fulls)


def test_destination_dying_in_commit_rolls_the_others_back(cluster):
    """Atomic refits commit in a second call (non-atomic ones have none). The survivor holds
    several tensors, one larger than a commit swaps at once (16 MiB): all get their old bytes
    back, and its version goes back."""
    src, dst = actors(2, 0), actors(2, 1, max_restarts=0)
    specs = {"w": spec(), "big": spec((4608, 2048)), "b": spec((8,), ROWS_L, L([0, 1], rr.Replicate()))}
    with rr.ReshardGroup(src, dst, timeout_s=30) as g:
        old = load(src, dst, specs, 0)
        g.refit(specs)
        load(src, [], specs, 1)                       # sources move on; destinations keep v1
        ray.get(dst[1].__ray_call__.remote(_die_at("commit")))
        with pytest.raises(rr.RefitError, match=r"in commit on dst rank 1: process \d died"
                                               r".*rolled back to v1") as info:
            g.refit(specs, atomic=True)
        assert info.value.failed_ranks == (("dst", 1),)
        assert g.version == 1
        assert ray.get(dst[0].__ray_call__.remote(worker.version, g.group_id)) == 1
        got = ray.get(dst[0].get.remote())
        assert got["big"].numel() * 4 > 16 << 20
        for n, s in specs.items():                    # the old weights are back, every one
            assert torch.equal(got[n], rr.shard_tensor(old[n], s.dst, 0)), n


def test_restarted_actor_is_named_and_update_recovers(cluster):
    src = actors(2, 0)
    dst = actors(2, 1, max_restarts=1)
    specs = {"w": spec()}
    with rr.ReshardGroup(src, dst, timeout_s=10) as g:
        load(src, dst, specs, 0)
        g.refit(specs)
        pid = ray.get(dst[1].__ray_call__.remote(lambda self: os.getpid()))
        ray.kill(dst[1], no_restart=False)
        t_end = time.monotonic() + 60
        while True:                                   # wait until Ray restarted it
            try:
                if ray.get(dst[1].__ray_call__.remote(lambda self: os.getpid()), timeout=5) != pid:
                    break
            except Exception:
                pass
            assert time.monotonic() < t_end
            time.sleep(0.2)
        with pytest.raises(rr.RefitError, match=r"dst rank 1.*restarted .*call "
                                               r"ReshardGroup.update\(\)"):
            g.refit(specs)
        g.update()                                    # same handles: probed again
        fulls = load(src, dst, specs, 2)
        g.refit(specs)
        assert exact(dst, specs, fulls)


def _inference_zeros(shape):
    with torch.inference_mode():
        return torch.zeros(shape)


@ray.remote(num_cpus=0)
class InferenceHolder(Holder.__ray_actor_class__):
    """Destinations allocated under torch.inference_mode(), as inference engines do."""

    def set(self, tensors):
        with torch.inference_mode():
            self.tensors = {k: v.clone() for k, v in tensors.items()}


@pytest.fixture(scope="module")
def inference_dst(cluster):
    return [InferenceHolder.options(resources={"node1": 1}).remote() for _ in range(2)]


@pytest.mark.parametrize("strategy", ["reshard", "gather_broadcast"])
def test_inference_tensors_are_written(pair, inference_dst, strategy):
    src, dst = pair[0], inference_dst
    specs = {"w": spec(), "b": spec((8,), L([0, 1], rr.Replicate()), ROWS_L)}
    with rr.ReshardGroup(src, dst, timeout_s=30, strategy=strategy) as g:
        for step, atomic in enumerate([False, True]):
            fulls = load(src, dst, specs, step)
            assert all(ray.get([a.__ray_call__.remote(
                lambda self: all(t.is_inference() for t in self.tensors.values())) for a in dst]))
            g.refit(specs, atomic=atomic)
            assert exact(dst, specs, fulls)


@pytest.mark.parametrize("strategy", ["reshard", "gather_broadcast"])
def test_empty_tensors(pair, strategy):
    src, dst = pair
    only_empty = {"e": spec((0, 8)), "f": spec((8, 0), src=COLS_L, dst=ROWS_L)}
    mixed = {**only_empty, "w": spec()}
    with rr.ReshardGroup(src, dst, timeout_s=30, strategy=strategy) as g:
        for specs in (only_empty, mixed):
            fulls = load(src, dst, specs, 1)
            res = g.refit(specs)
            assert exact(dst, specs, fulls)
        assert res.version == 2


def _raise_after_checks(self):
    """In this actor's process, the next refit fails once every process's checks passed
    (where an out-of-memory in atomic staging or a snapshot copy would)."""
    from ray_reshard.runtime import executor
    real = executor.run_program

    def failing(*args, **kwargs):
        executor.run_program = real
        raise MemoryError("staging allocation failed")
    executor.run_program = failing


def test_failure_after_checks_fails_fast(pair):
    """A rank failing after the processes agreed to move bytes wakes every peer: RefitError
    in seconds, naming it and its cause, not at the deadline; update() brings the group back."""
    src, dst = pair
    specs = {"w": spec((256, 256))}
    timeout = 20.0
    with rr.ReshardGroup(src, dst, timeout_s=timeout) as g:
        load(src, dst, specs, 0)
        g.refit(specs)
        ray.get(dst[1].__ray_call__.remote(_raise_after_checks))
        t0 = time.monotonic()
        with pytest.raises(rr.RefitError, match=r"dst rank 1.*staging allocation failed") as info:
            g.refit(specs)
        took = time.monotonic() - t0
        assert info.value.failed_ranks == (("dst", 1),)
        assert took < timeout / 2, f"{took:.1f} s to RefitError"
        g.update()
        fulls = load(src, dst, specs, 1)
        g.refit(specs)
        assert exact(dst, specs, fulls)


def test_lookup_failure_refuses_the_refit_everywhere(pair):
    """A tensors() lookup that raises in one process: every process is told before any byte
    moves (one call per refit: they agree through the group's store), the refit is refused
    naming it, and the group stays usable (no update() needed)."""
    src, dst = pair
    specs = {"w": spec((256, 256))}

    def tensors(actor):
        if getattr(actor, "faulty", False):
            raise RuntimeError("tensor lookup failed")
        return actor.tensors

    with rr.ReshardGroup(src, dst, timeout_s=20.0, tensors=tensors) as g:
        fulls = load(src, dst, specs, 0)
        g.refit(specs)
        before = ray.get(dst[0].get.remote())
        load(src, [], specs, 1)
        ray.get(dst[1].__ray_call__.remote(lambda self: setattr(self, "faulty", True)))
        t0 = time.monotonic()
        with pytest.raises(rr.RefitError, match=r"(?s)refused before moving any byte.*"
                                                r"dst rank 1.*tensor lookup failed"):
            g.refit(specs)
        assert time.monotonic() - t0 < 5
        assert torch.equal(ray.get(dst[0].get.remote())["w"], before["w"])
        assert g.version == 1 and g.versions() == [1] * 4
        ray.get(dst[1].__ray_call__.remote(lambda self: setattr(self, "faulty", False)))
        fulls = load(src, dst, specs, 2)
        assert g.refit(specs).version == 2 and exact(dst, specs, fulls)


def test_stopped_node_helper_is_a_refit_error_within_the_deadline(cluster):
    """A node helper that stops answering (SIGSTOP) while a refit needs new rings: RefitError
    naming it within the refit's deadline, not a raw Ray timeout; the group recovers."""
    import signal

    src, dst = actors(2, 0), actors(2, 0)
    small = {"s": spec()}
    big = {"b": spec((256, 1024))}                   # needs larger rings than `small`
    with rr.ReshardGroup(src, dst, timeout_s=5) as g:
        load(src, dst, small, 0)
        g.refit(small)
        helper = next(iter(g.resources()["helpers"].values()))
        pid = ray.get(helper.__ray_call__.remote(lambda self: os.getpid()))
        os.kill(pid, signal.SIGSTOP)
        try:
            load(src, dst, big, 1)
            t0 = time.monotonic()
            with pytest.raises(rr.RefitError, match=r"node helper on node .* did not answer "
                                                   r"create_rings\(\) within"):
                g.refit(big, timeout_s=5)
            assert time.monotonic() - t0 < 5 + 3
        finally:
            os.kill(pid, signal.SIGCONT)
        g.update()
        fulls = load(src, dst, big, 2)
        g.refit(big)
        assert exact(dst, big, fulls)
