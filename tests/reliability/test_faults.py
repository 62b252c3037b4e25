"""Dead and hung ranks: refit raises RefitError naming them within its deadline, never hangs;
nothing of the failed group leaks; update() (replacement actors, new layouts) brings it back,
bit-exact.

One group serves the whole module (building groups and starting actors costs seconds on a
loaded 2-core machine): each test starts from a healthy group, breaks it, checks the failure and
the leaks, repairs it with update() and checks the next refit. Destinations replicate each other
(dp x tp=1) across two ranks on one node, so refits use both the network (gloo, node to node)
and a shared-memory ring (the domain exchange between the replicas).
"""
import os
import sys
import threading
import time

import pytest
import ray
import torch
from ray import cloudpickle

import ray_reshard as rr
from ray_reshard.layout.placement import Replicate, Shard
from ray_reshard.tools.testing import Holder, start_cluster

from reliability_util import L, assert_no_leaks, check_exact, fill, raw, same_raw

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(240)

TIMEOUT = 4.0           # refit deadline in these tests
GRACE = 5.0             # what ReshardGroup waits past it before declaring a rank hung
MARGIN = 6.0            # scheduling noise on a loaded 2-core machine
FAILURES = []           # (what, seconds to RefitError): printed at the end of the module
SLOWER_S = 9.0          # a lookup this slow outlasts a 1 s deadline and its grace


def new_actors(n, node):
    return [Holder.options(resources={f"node{node}": 1}, max_restarts=0).remote()
            for _ in range(n)]


class Rig:
    def __init__(self):
        src, dst = new_actors(2, 0), new_actors(2, 1)
        self.spares = {0: new_actors(2, 0), 1: new_actors(7, 1)}
        ray.get([a.node.remote() for a in src + dst + self.spares[0] + self.spares[1]])
        self.step = 0
        self.group = rr.ReshardGroup(src, dst, tensors=lookup, timeout_s=TIMEOUT)
        self.refit_ok()

    @property
    def src(self):
        return list(self.group.src_actors)

    @property
    def dst(self):
        return list(self.group.dst_actors)

    def spare(self, node):
        return self.spares[node].pop()

    def specs(self):
        return specs_for(len(self.src), len(self.dst))

    def refit_ok(self):
        """A good refit of fresh values: bit-exact, every process at the new version."""
        self.step += 1
        specs, fulls = self.specs(), fulls_for(self.step)
        fill(self.src, self.dst, specs, fulls, dst_seed=self.step)
        res = self.group.refit(specs, timeout_s=30)
        check_exact(self.dst, specs, fulls)
        assert self.group.versions() == [res.version] * len(set(self.src + self.dst))
        return res

    def snapshot_old(self):
        g, held = self.group, self.group.resources()
        return g.group_id, g.group_name, held["segments"], held["helpers"]


@pytest.fixture(scope="module")
def rig():
    c = start_cluster(2)
    r = Rig()
    yield r
    r.group.close()
    print("\nseconds from fault to RefitError:", ", ".join(f"{w} {s:.2f}" for w, s in FAILURES))
    ray.shutdown()
    c.shutdown()


def specs_for(n_src=2, n_dst=2):
    src = L(list(range(n_src)), Shard(0))
    dst = L([[r] for r in range(n_dst)], Replicate(), Shard(0), names=("dp", "tp"))
    return {"w": rr.TensorSpec((64, 32), torch.float32, src, dst),
            "v": rr.TensorSpec((48,), torch.bfloat16, L(list(range(n_src)), Replicate()), dst,
                               src_dtype=torch.float32)}


def fulls_for(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "v": torch.randn(48, generator=g)}


def lookup(actor):
    """The group's tensors= callable: misbehaves on demand (armed from the driver by arm())."""
    fault = getattr(actor, "rr_fault", None)
    if fault is not None:
        kind, skip = fault
        if skip > 0:                       # let this many lookups pass first (one per refit)
            actor.rr_fault = (kind, skip - 1)
        else:
            actor.rr_fault = None
            if kind == "exit":
                os._exit(1)
            if kind == "hang":
                time.sleep(30)
            if kind == "slow":
                time.sleep(2.0)
            if kind == "slower":
                time.sleep(SLOWER_S)
    return actor.tensors


def arm(actor, kind, skip=0):
    """Misbehave at lookup number skip+1 from now: skip=0 is the next refit's (each refit
    looks its tensors up once, before the processes agree to move bytes)."""
    ray.get(actor.__ray_call__.remote(lambda self: setattr(self, "rr_fault", (kind, skip))))


def arm_after_run(actor, kind, pause_s=1.5):
    """Misbehave in the next refit once this process's own transfers are done (every byte it
    sends or receives has moved): `pause_s` later (its peers finish theirs meanwhile), "exit"
    ends the process before it reports; "hang" holds the call for 30 s."""
    def patch(self):
        from ray_reshard.runtime import executor

        real = executor.run_program

        def run_then_fail(*args, **kwargs):
            executor.run_program = real
            out = real(*args, **kwargs)
            time.sleep(pause_s)
            if kind == "exit":
                os._exit(1)
            time.sleep(30)
            return out
        executor.run_program = run_then_fail
    ray.get(actor.__ray_call__.remote(patch))


def holds(actors_, specs, fulls) -> list:
    """Per actor: whether every tensor it holds equals its shard of `fulls`."""
    got = ray.get([a.get.remote() for a in actors_])
    out = []
    for r, tensors in enumerate(got):
        ok = True
        for name, spec in specs.items():
            if spec.dst.box(r, spec.shape) is not None:
                want = rr.shard_tensor(fulls[name].to(spec.dtype), spec.dst, r)
                ok = ok and torch.equal(tensors[name].view(torch.uint8), want.view(torch.uint8))
        out.append(ok)
    return out


def failing_refit(rig, what, within):
    """The refit fails with RefitError in under `within` seconds; versions do not move."""
    v = rig.group.version
    t0 = time.monotonic()
    with pytest.raises(rr.RefitError) as info:
        rig.group.refit(rig.specs(), timeout_s=TIMEOUT)
    elapsed = time.monotonic() - t0
    FAILURES.append((what, elapsed))
    assert elapsed < within, f"{what}: RefitError after {elapsed:.1f} s"
    assert rig.group.version == v
    # A broken group refuses refits until update().
    with pytest.raises(rr.RefitError, match=r"failed earlier .*call update\(\)"):
        rig.group.refit(rig.specs())
    return info.value


@pytest.mark.parametrize("side, rank", [("src", 1), ("dst", 0)])
def test_killed_before_refit(rig, side, rank):
    old = rig.snapshot_old()
    src, dst = rig.src, rig.dst
    victim = (src if side == "src" else dst)[rank]
    ray.kill(victim, no_restart=True)
    err = failing_refit(rig, f"{side}{rank} dead before", TIMEOUT + MARGIN)
    assert err.failed_ranks == ((side, rank),), err
    assert f"refit failed in run on {side} rank {rank}" in str(err)
    assert "died" in str(err)
    # Same layouts, a replacement actor in the dead one's place.
    fresh = rig.spare(0 if side == "src" else 1)
    (src if side == "src" else dst)[rank] = fresh
    rig.group.update(src_actors=src, dst_actors=dst)
    assert_no_leaks(*old, [a for a in src + dst if a is not fresh])
    rig.refit_ok()


def test_source_exits_during_run_then_new_layouts(rig):
    old = rig.snapshot_old()
    src, dst = rig.src, rig.dst
    specs, new = rig.specs(), fulls_for(1000)
    fill(src, dst, specs, new, dst_seed=1000)
    arm_after_run(src[0], "exit")                    # dies in run, after its bytes moved
    err = failing_refit(rig, "src0 exits in run", TIMEOUT + MARGIN)
    assert err.failed_ranks == (("src", 0),), err
    assert "refit failed in run on src rank 0: process 0 died" in str(err)
    # the fault struck after the transfers: the destinations hold the new weights (in place),
    # yet the refit failed and no process reports the new version
    assert holds(dst, specs, new) == [True, True]
    # New layouts: the surviving source alone feeds three destinations (one of them new).
    src, dst = src[1:], dst + [rig.spare(1)]
    rig.group.update(src_actors=src, dst_actors=dst)
    assert_no_leaks(*old, src + dst[:-1])
    assert len(rig.group.src_actors) == 1 and len(rig.group.dst_actors) == 3
    rig.refit_ok()
    # ... and back to two sources, with a new actor.
    src = [src[0], rig.spare(0)]
    rig.group.update(src_actors=src, dst_actors=dst[:2])
    rig.refit_ok()


def test_destination_killed_from_driver_while_refit_runs(rig):
    src, dst = rig.src, rig.dst
    old = rig.snapshot_old()
    fill(src, dst, rig.specs(), fulls_for(99), dst_seed=99)
    arm(dst[1], "slow")                              # holds the refit open for 2 s
    killer = threading.Timer(0.7, lambda: ray.kill(dst[0], no_restart=True))
    killer.start()
    err = failing_refit(rig, "dst0 killed in run", TIMEOUT + GRACE + MARGIN)
    killer.join()
    assert ("dst", 0) in err.failed_ranks, err
    assert "process 2 died" in str(err)
    dst[0] = rig.spare(1)
    rig.group.update(dst_actors=dst)
    assert_no_leaks(*old, src + dst[1:])
    rig.refit_ok()


def test_hung_rank_named_within_deadline(rig):
    """A rank stuck before the processes agree to move bytes: its peers, waiting on it, are
    named as waiting, not blamed."""
    dst = rig.dst
    old = rig.snapshot_old()
    arm(dst[1], "hang")                              # alive, stuck in its lookup for 30 s
    err = failing_refit(rig, "dst1 hung at lookup", TIMEOUT + GRACE + MARGIN)
    assert err.failed_ranks == (("dst", 1),), err
    assert "process 3 did not finish within" in str(err)
    assert "then, waiting on them:" in str(err)      # its peers timed out on it: named, not blamed
    replace_hung_dst1(rig, old)


def replace_hung_dst1(rig, old):
    """Swap hung destination 1 for a spare: update() must not wait on it, nothing leaks, and
    the repaired group refits."""
    src, dst = rig.src, rig.dst
    hung, dst[1] = dst[1], rig.spare(1)
    t0 = time.monotonic()
    rig.group.update(dst_actors=dst)
    assert time.monotonic() - t0 < 10, "update() waited on the hung process"
    assert_no_leaks(*old, src + dst[:1])
    rig.refit_ok()
    ray.kill(hung, no_restart=True)


def test_rank_hung_after_bytes_moved_named_within_deadline(rig):
    """A rank that hangs in run after its transfers (and the forwards its replica needed from
    it) completed: the refit still fails within its deadline, naming it alone."""
    src, dst = rig.src, rig.dst
    old = rig.snapshot_old()
    specs, new = rig.specs(), fulls_for(2000)
    fill(src, dst, specs, new, dst_seed=2000)
    arm_after_run(dst[1], "hang")
    err = failing_refit(rig, "dst1 hung in run", TIMEOUT + GRACE + MARGIN)
    assert err.failed_ranks == (("dst", 1),), err
    assert "process 3 did not finish within" in str(err)
    assert holds(dst[:1], specs, new) == [True]      # bytes had moved, through dst1 too
    replace_hung_dst1(rig, old)


def test_busy_actor_named_within_deadline(rig):
    """The refit's calls queue behind a long user method: the deadline holds all the same,
    nothing is written, and update() with the same actors recovers once it is free."""
    src, dst = rig.src, rig.dst
    before = raw(dst)
    busy = src[1].__ray_call__.remote(lambda self: time.sleep(TIMEOUT + GRACE + 3))
    err = failing_refit(rig, "src1 busy", TIMEOUT + GRACE + MARGIN)
    assert err.failed_ranks == (("src", 1),), err
    assert "refit failed in run on src rank 1: process 1 did not finish within" in str(err)
    assert all(same_raw(a, b) for a, b in zip(before, raw(dst)))
    ray.get(busy)
    rig.group.update()                               # same actors, group rebuilt
    rig.refit_ok()


def test_update_with_a_dead_member_fails_fast_and_names_it(rig):
    """update() with the same actors after one died: RefitError naming it, at once, and no live
    actor is left blocked joining a collective group that can never complete."""
    src, dst = rig.src, rig.dst
    ray.kill(dst[1], no_restart=True)
    t0 = time.monotonic()
    with pytest.raises(rr.RefitError) as info:
        rig.group.update()
    assert time.monotonic() - t0 < MARGIN
    assert info.value.failed_ranks == (("dst", 1),), info.value
    assert "refit failed in setup on dst rank 1: process 3 died" in str(info.value)
    with pytest.raises(rr.RefitError, match="failed earlier"):
        rig.group.refit(rig.specs())
    # The live members answer at once (none is stuck in a rendezvous).
    ray.get([a.node.remote() for a in src + dst[:1]], timeout=MARGIN)
    dst[1] = rig.spare(1)
    rig.group.update(dst_actors=dst)
    rig.refit_ok()


def test_node_helper_killed(rig):
    """Helpers only create rings; one that dies is replaced when rings are next needed."""
    dst = rig.dst
    for h in list(rig.group.resources()["helpers"].values()):
        ray.kill(h, no_restart=True)
    rig.refit_ok()                                   # rings already mapped: unaffected
    dst[0] = rig.spare(1)                            # new member: new rings, new helpers
    t0 = time.monotonic()
    rig.group.update(dst_actors=dst)
    rig.refit_ok()
    assert time.monotonic() - t0 < 3 * MARGIN
    assert all(ray.get([h.ping.remote() for h in rig.group.resources()["helpers"].values()], timeout=30))


def test_a_refits_own_timeout_wins_over_the_groups(rig):
    """refit(timeout_s=...) bounds that refit whatever the group's timeout_s: shorter (a hung
    rank is named within it) or longer (a slow rank finishes)."""
    src, dst = new_actors(2, 0), new_actors(2, 1)
    specs, fulls = specs_for(), fulls_for(100)
    fill(src, dst, specs, fulls, dst_seed=100)
    with rr.ReshardGroup(src, dst, tensors=lookup, timeout_s=60) as g:
        arm(dst[1], "hang")
        t0 = time.monotonic()
        with pytest.raises(rr.RefitError, match=r"dst rank 1"):
            g.refit(specs, timeout_s=2)
        assert time.monotonic() - t0 < 2 + GRACE + MARGIN
    dst = [dst[0], new_actors(1, 1)[0]]
    fill(src, dst, specs, fulls, dst_seed=101)
    with rr.ReshardGroup(src, dst, tensors=lookup, timeout_s=1) as g:
        arm(dst[1], "slower")
        g.refit(specs, timeout_s=60)
        check_exact(dst, specs, fulls)
