"""Faults named as faults, and checks that hold after capture:

* an exception in the actor's own code (its `reshard_tensors()`) is a fault of that rank:
  `RefitError` with `failed_ranks` and the exception as `__cause__`, destinations untouched;
  specs that do not match the tensors stay a `ValueError`;
* storage freed between refits (`untyped_storage().resize_(0)`, as FSDP frees unsharded
  parameters) is refused before any byte moves;
* once `refit_async` captured the sources, the live sources are the trainer's business;
* a new replica joins only from replicas at the group's version;
* each cached program's memory is reported, and memory stays proportional to what is cached.
"""
import sys
import time

import pytest
import ray
import torch
from ray import cloudpickle

import ray_reshard as rr
from ray_reshard.layout.placement import Replicate, Shard

from reliability_util import L, raw, same_raw

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(240)


class DeviceLost(RuntimeError):
    """What a user's code might raise (a lost device, an OOM, a bug)."""


@ray.remote(num_cpus=0, max_concurrency=2)
class Trainer:
    """A user actor holding tensors, whose reshard_tensors() raises when told to."""

    def __init__(self):
        self.tensors = {}
        self.fail = False
        self.lookups = 0
        self.pause = (0, 0.0)

    def set(self, tensors):
        self.tensors = {k: v.clone() for k, v in tensors.items()}

    def get(self):
        return self.tensors

    def set_fail(self, fail):
        self.fail = fail

    def pause_lookup(self, nth, seconds):
        """The nth lookup from now sleeps `seconds` first."""
        self.pause = (self.lookups + nth, seconds)

    def reshard_tensors(self):
        self.lookups += 1
        if self.pause[0] == self.lookups:
            time.sleep(self.pause[1])
        if self.fail:
            raise DeviceLost("CUDA error: device lost while reading parameters")
        return self.tensors

    def node(self):
        return ray.get_runtime_context().get_node_id()


def trainers(n, node):
    return [Trainer.options(resources={f"node{node}": 1}).remote() for _ in range(n)]


SPECS = {"w": rr.TensorSpec((16, 8), torch.float32, L([0, 1], Shard(0)), L([0, 1], Shard(1))),
         "b": rr.TensorSpec((8,), torch.float32, L([0, 1], Replicate()), L([0, 1], Shard(0)))}


def load(src, dst, gen, specs=SPECS):
    """Sources get their shards of new random full tensors (returned); destinations noise."""
    g = torch.Generator().manual_seed(gen)
    f = {n: torch.randn(s.shape, generator=g) for n, s in specs.items()}
    ray.get([a.set.remote({n: rr.shard_tensor(f[n], s.src, r) for n, s in specs.items()
                           if s.src.box(r, s.shape) is not None}) for r, a in enumerate(src)])
    if dst:
        g = torch.Generator().manual_seed(1000 + gen)
        ray.get([a.set.remote({n: torch.randn(s.dst.local_shape(r, s.shape), generator=g)
                               for n, s in specs.items() if s.dst.box(r, s.shape) is not None})
                 for r, a in enumerate(dst)])
    return f


def exact(dst, specs, f):
    got = ray.get([a.get.remote() for a in dst])
    return all(torch.equal(got[r][n], rr.shard_tensor(f[n], s.dst, r))
               for n, s in specs.items() for r in range(len(dst))
               if s.dst.box(r, s.shape) is not None)


@pytest.fixture(scope="module")
def pair(cluster):
    src, dst = trainers(2, 0), trainers(2, 1)
    ray.get([a.node.remote() for a in src + dst])
    return src, dst


# ------------------------------------------------------------------ a fault in user code
@pytest.mark.parametrize("overlapped", [False, True])
def test_exception_in_reshard_tensors_is_a_refit_error_of_that_rank(pair, overlapped):
    src, dst = pair
    with rr.ReshardGroup(src, dst, timeout_s=20.0) as g:
        load(src, dst, 0)
        g.refit(SPECS)
        f = load(src, [], 1)
        before = raw(dst)
        ray.get(src[1].set_fail.remote(True))
        try:
            t0 = time.monotonic()
            with pytest.raises(rr.RefitError, match=r"src rank 1.*reshard_tensors\(\) raised "
                                                    r"DeviceLost: CUDA error: device lost") as e:
                if overlapped:
                    g.refit_async(SPECS).wait()
                else:
                    g.refit(SPECS)
            assert time.monotonic() - t0 < 10
            assert e.value.failed_ranks == (("src", 1),)
            assert isinstance(e.value.__cause__, DeviceLost)
            assert "device lost" in str(e.value.__cause__)
            assert all(same_raw(a, b) for a, b in zip(before, raw(dst)))
            assert g.version == 1 and g.versions() == [1] * 4
        finally:
            ray.get(src[1].set_fail.remote(False))
        # the group stays usable: no update() needed once the actor's code works again
        assert g.refit(SPECS).version == 2 and exact(dst, SPECS, f)


def test_specs_that_do_not_match_the_tensors_stay_a_value_error(pair):
    src, dst = pair
    with rr.ReshardGroup(src, dst, timeout_s=20.0) as g:
        load(src, dst, 0)
        wrong = {"w": rr.TensorSpec((16, 6), torch.float32, L([0, 1], Shard(0)),
                                    L([0, 1], Shard(1)))}
        with pytest.raises(ValueError, match=r"'w' on src rank 0: local shard has shape"):
            g.refit(wrong)
        with pytest.raises(ValueError, match=r"'w' on src rank 0: local shard has shape"):
            g.refit_async(wrong).wait()
        f = load(src, dst, 3)
        g.refit(SPECS)
        assert exact(dst, SPECS, f)


# ------------------------------------------------------------------ freed storage
def _free(actor, name):
    actor.tensors[name].untyped_storage().resize_(0)


def _raw_live(actor):
    """Every local tensor with memory behind it, as raw bytes (a freed one cannot be read)."""
    return {k: v.reshape(-1).view(torch.uint8).clone() for k, v in actor.tensors.items()
            if v.untyped_storage().nbytes() > 0}


def live(actors_):
    return ray.get([a.__ray_call__.remote(_raw_live) for a in actors_])


def same_live(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("side", ["dst", "src"])
def test_freed_storage_is_refused_before_any_byte_moves(pair, side):
    """Destination 1's (or source 1's) 'w' freed between refits, as FSDP frees unsharded
    parameters: refused naming it, nothing written anywhere, no update() needed."""
    src, dst = pair
    with rr.ReshardGroup(src, dst, timeout_s=20.0) as g:
        load(src, dst, 0)
        g.refit(SPECS)                  # the checks of these tensors are cached now
        f = load(src, [], 1)
        victim = (dst if side == "dst" else src)[1]
        ray.get(victim.__ray_call__.remote(_free, "w"))
        before = live(dst)
        with pytest.raises(ValueError, match=rf"(?s)refused before moving any byte.*'w' on "
                                             rf"{side} rank 1: local 'w' has no memory behind "
                                             rf"its shard: its storage holds 0 bytes"):
            g.refit(SPECS)
        assert all(same_live(a, b) for a, b in zip(before, live(dst)))
        assert g.version == 1 and g.versions() == [1] * 4
        f = load(src, dst, 2)           # memory back (new tensors): the next refit works
        assert g.refit(SPECS).version == 2 and exact(dst, SPECS, f)


# ------------------------------------------------------------------ after capture
def _trainer_step(actor):
    """What a trainer may do once the sources are captured: drop a tensor, change another."""
    del actor.tensors["w"]
    actor.tensors["b"].add_(100.0)


def test_refit_async_sends_the_captured_sources_whatever_the_trainer_does_next(pair):
    src, dst = pair
    with rr.ReshardGroup(src, dst, timeout_s=20.0) as g:
        load(src, dst, 0)
        g.refit(SPECS)
        f = load(src, [], 1)
        # Source 0's next lookup after the capture (if any) waits until the step below is done.
        ray.get(src[0].pause_lookup.remote(2, 3.0))
        pending = g.refit_async(SPECS)
        ray.get(src[0].__ray_call__.remote(_trainer_step))
        res = pending.wait()
        assert res.version == 2 and exact(dst, SPECS, f)
        assert g.versions() == [2] * 4
        f = load(src, dst, 2)           # the trainer's tensors back: plain refits go on
        assert g.refit(SPECS).version == 3 and exact(dst, SPECS, f)


# ------------------------------------------------------------------ joining from a replica
def _fail_after_run(actor):
    """This process's next run writes everything, then fails (its refit fails part-way)."""
    from ray_reshard.runtime import executor

    real = executor.run_program

    def run_then_fail(*args, **kwargs):
        executor.run_program = real
        real(*args, **kwargs)
        raise RuntimeError("failed after its bytes moved")
    executor.run_program = run_then_fail


def replicated_specs():
    train = L([0, 1], Shard(0))
    infer = L([[0, 1], [2, 3]], Replicate(), Shard(1), names=("dp", "tp"))
    return {"w": rr.TensorSpec((16, 8), torch.float32, train, infer)}


def test_join_copies_only_from_a_replica_at_the_groups_version(pair):
    src = pair[0]
    engines, new, spare = trainers(4, 1), trainers(2, 1), trainers(1, 1)[0]
    specs = replicated_specs()
    with rr.ReshardGroup(src, engines, timeout_s=20.0) as g:
        load(src, engines, 1, specs)
        g.refit(specs)
        assert g.stale_destinations() == {}
        # Engine 2 (replica 1) replaced: the fresh actor holds no refit yet.
        ray.get(spare.set.remote({"w": torch.zeros(16, 4)}))
        g.update(dst_actors=engines[:2] + [spare, engines[3]])
        assert list(g.stale_destinations()) == [2]
        load([], new, 0, specs)
        with pytest.raises(rr.RefitError, match=r"replica \{'dp': 1\} does not hold the "
                                                r"group's version v1 \(dst rank 2: update\(\) "
                                                r"added it") as e:
            g.join(specs, {"dp": 1}, new)
        assert e.value.failed_ranks == (("dst", 2),)
        # A refit that fails part-way (not atomic): every destination may hold a mix.
        engines = g.dst_actors
        f2 = load(src, [], 2, specs)
        ray.get(engines[3].__ray_call__.remote(_fail_after_run))
        with pytest.raises(rr.RefitError):
            g.refit(specs)
        g.update()
        assert sorted(g.stale_destinations()) == [0, 1, 2, 3]
        with pytest.raises(rr.RefitError, match=r"v2 failed part-way") as e:
            g.join(specs, {"dp": 0}, new)
        assert e.value.failed_ranks == (("dst", 0), ("dst", 1))
        with pytest.warns(RuntimeWarning, match="may not hold v1"):
            res = g.join(specs, {"dp": 0}, new, allow_stale=True)
        assert res.version == -1 and res.warnings
        # A refit that completes makes every replica a good source again.
        g.refit(specs)
        assert g.stale_destinations() == {}
        load([], new, 0, specs)
        res = g.join(specs, {"dp": 1}, new)
        assert res.version == 2 and exact(new, replicated_specs_mirror(specs), f2)
    for a in engines + new:
        ray.kill(a)


def replicated_specs_mirror(specs):
    """What the new actors hold after a mirror join: replica 1's layout over ranks 0, 1."""
    return {n: rr.TensorSpec(s.shape, s.dtype, s.src, L([0, 1], Shard(1))) for n, s in specs.items()}


# ------------------------------------------------------------------ memory per program
def _traced(actor, start=False):
    import gc
    import tracemalloc
    if start:
        tracemalloc.start()
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def _stop_tracing(actor):
    import tracemalloc
    tracemalloc.stop()


def spec_set(i):
    """Distinct spec sets: 12 tensors whose row count depends on i."""
    return {f"t{j}": rr.TensorSpec((8 + 2 * i, 16), torch.float32, L([0, 1], Shard(0)),
                                   L([0, 1], Shard(1)) if j % 2 else L([0, 1], Replicate()))
            for j in range(12)}


def test_memory_per_program_is_reported_and_stays_proportional_to_the_programs_cached(pair):
    from ray_reshard.runtime import worker
    src, dst = pair
    with rr.ReshardGroup(src, dst, timeout_s=20.0, max_programs=2) as g:
        for i in range(2):
            load(src, dst, i, spec_set(i))
            g.refit(spec_set(i))
        held = g.resources(measure=True)
        assert held["programs"] == 2 and len(held["program_bytes"]) == 2
        per_program = max(held["program_bytes"].values())
        assert per_program > 0 and all(n > 0 for n in held["program_bytes"].values())
        ray.get([a.__ray_call__.remote(_traced, True) for a in src + dst])
        try:
            for i in range(2, 5):                # the programs cached now were made while traced
                load(src, dst, i, spec_set(i))
                g.refit(spec_set(i))
            base = ray.get([a.__ray_call__.remote(_traced) for a in src + dst])
            for i in range(5, 11):               # 6 more spec sets, each evicting an older one
                load(src, dst, i, spec_set(i))
                g.refit(spec_set(i))
            after = ray.get([a.__ray_call__.remote(_traced) for a in src + dst])
        finally:
            ray.get([a.__ray_call__.remote(_stop_tracing) for a in src + dst])
        held = g.resources(measure=True)
        assert held["programs"] == 2 and len(held["program_bytes"]) == 2
        assert held["plans"] == 2
        per_proc = ray.get([a.__ray_call__.remote(worker.held_resources, g.group_id)
                            for a in src + dst])
        assert all(h["programs"] == 2 and len(h["program_bytes"]) == 2 for h in per_proc)
        assert sum(sum(h["program_bytes"].values()) for h in per_proc) == \
            sum(held["program_bytes"].values())
        # Python memory in each process grew by less than one program's share in 6 refits of
        # new spec sets: evicted programs are freed, not kept.
        for b, a, h in zip(base, after, per_proc):
            assert a - b < max(h["program_bytes"].values()), (b, a, h["program_bytes"])
