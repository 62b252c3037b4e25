"""A catalogue of malformed refits: each fails before any byte moves.

Every case checks three things: the call raises with a message that names the tensor, the rank
and what was expected (pinned with `match=`); every destination (and source) tensor is
bit-identical afterwards; and the group was refused, not broken (versions did not move and a good
refit right after succeeds).
"""
import sys
import types

import pytest
import ray
import torch
from ray import cloudpickle

import ray_reshard as rr
from ray_reshard.layout.placement import Replicate, Shard
from ray_reshard.runtime import worker
from ray_reshard.tools.testing import holders

# Functions of this module run inside actors: ship them by value (tests/ is not importable there).
cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def actors(cluster):
    a = holders(2, 0) + holders(2, 1)          # sources on node 0, destinations on node 1
    ray.get([x.node.remote() for x in a])
    return a


@pytest.fixture(scope="module")
def src(actors):
    return actors[:2]


@pytest.fixture(scope="module")
def dst(actors):
    return actors[2:]


def L(ranks, *placements):
    return rr.Layout(rr.Mesh(ranks), placements)


ROWS = L([0, 1], Shard(0))
COLS = L([0, 1], Shard(1))
REP = L([0, 1], Replicate())
FULL = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8) / 7,
        "b": torch.arange(8, dtype=torch.float32) - 3.5}


def good_specs(**over):
    specs = {"w": rr.TensorSpec((8, 8), torch.float32, ROWS, COLS),
             "b": rr.TensorSpec((8,), torch.float32, REP, ROWS)}
    specs.update(over)
    return specs


def load(src, dst, generation=0):
    """Good tensors everywhere: sources hold FULL + generation, destinations random bits."""
    specs = good_specs()
    g = torch.Generator().manual_seed(100 + generation)
    ray.get([a.set.remote({n: rr.shard_tensor(FULL[n] + generation, specs[n].src, r)
                           for n in specs}) for r, a in enumerate(src)])
    ray.get([a.set.remote({n: torch.randn(specs[n].dst.local_shape(r, specs[n].shape),
                                          generator=g) for n in specs})
             for r, a in enumerate(dst)])


def snapshot(actors_):
    """Every local tensor of every actor, as raw bytes (NaN-safe, dtype-exact)."""
    out = []
    for tensors in ray.get([a.__ray_call__.remote(_dump) for a in actors_]):
        out.append(tensors)
    return out


def _dump(actor):
    out = {}
    for k, v in actor.tensors.items():
        if isinstance(v, torch.Tensor) and v.device.type == "cpu":
            out[k] = (v.dtype, tuple(v.shape), v.detach().contiguous().view(-1).view(torch.uint8).clone())
        else:
            out[k] = repr(type(v)) if not isinstance(v, torch.Tensor) else (v.dtype, tuple(v.shape), str(v.device))
    return out


def assert_unchanged(before, after):
    assert len(before) == len(after)
    for b, a in zip(before, after):
        assert b.keys() == a.keys()
        for k in b:
            if isinstance(b[k], tuple) and isinstance(b[k][2], torch.Tensor):
                assert b[k][:2] == a[k][:2], k
                assert torch.equal(b[k][2], a[k][2]), f"{k} changed"
            else:
                assert b[k] == a[k], k


def set_on(actor, name, value_fn):
    """Replace one local tensor inside the actor (value_fn runs there: meta tensors, etc.)."""
    def put(self):
        v = value_fn()
        if v is None:
            self.tensors.pop(name, None)
        else:
            self.tensors[name] = v
    ray.get(actor.__ray_call__.remote(put))


@pytest.fixture(scope="module")
def group(src, dst):
    with rr.ReshardGroup(src, dst, timeout_s=20) as g:
        load(src, dst)
        g.refit(good_specs())
        yield g


def refused(group, src, dst, specs, match, exc=ValueError, **kw):
    """Run a refit that must be refused; return the message."""
    before = snapshot(src + dst)
    v, vs = group.version, group.versions()
    with pytest.raises(exc, match=match) as info:
        group.refit(specs, **kw)
    assert_unchanged(before, snapshot(src + dst))
    assert group.version == v and group.versions() == vs
    return str(info.value)


def still_works(group, src, dst):
    """Refused, not broken: a good refit right after is bit-exact."""
    gen = group.version + 1
    load(src, dst, generation=gen)
    specs = good_specs()
    group.refit(specs)
    got = ray.get([a.get.remote() for a in dst])
    for n, spec in specs.items():
        for r in range(2):
            assert torch.equal(got[r][n], rr.shard_tensor(FULL[n] + gen, spec.dst, r)), (n, r)


# ------------------------------------------------------------------ specs vs local tensors
def test_wrong_global_shape_names_every_rank(group, src, dst):
    load(src, dst)
    msg = refused(group, src, dst, good_specs(w=rr.TensorSpec((8, 6), torch.float32, ROWS, COLS)),
                  r"refused before moving any byte")
    for line in (r"'w' on src rank 0: local shard has shape (4, 8), expected (4, 6)",
                 r"'w' on src rank 1: local shard has shape (4, 8), expected (4, 6)",
                 r"'w' on dst rank 0: local shard has shape (8, 4), expected (8, 3)",
                 r"'w' on dst rank 1: local shard has shape (8, 4), expected (8, 3)"):
        assert line in msg, msg
    assert "'b'" not in msg
    still_works(group, src, dst)


def test_wrong_dtype_in_spec(group, src, dst):
    load(src, dst)
    msg = refused(group, src, dst,
                  good_specs(b=rr.TensorSpec((8,), torch.bfloat16, REP, ROWS)),
                  r"'b' on src rank 0: local 'b' has dtype torch.float32, expected torch.bfloat16")
    assert "'b' on dst rank 1: local 'b' has dtype torch.float32, expected torch.bfloat16" in msg
    # only the source dtype wrong: destinations are fine and not mentioned
    msg = refused(group, src, dst,
                  good_specs(w=rr.TensorSpec((8, 8), torch.float32, ROWS, COLS,
                                             src_dtype=torch.float16)),
                  r"'w' on src rank 1: local 'w' has dtype torch.float32, expected torch.float16")
    assert "dst rank" not in msg
    still_works(group, src, dst)


def test_local_tensor_wrong_shape_on_one_rank(group, src, dst):
    load(src, dst)
    set_on(dst[1], "w", lambda: torch.zeros(8, 5))
    msg = refused(group, src, dst, good_specs(),
                  r"'w' on dst rank 1: local shard has shape \(8, 5\), expected \(8, 4\) "
                  r"\(global \(8, 8\)")
    assert msg.count("\n  ") == 1, msg       # exactly one problem listed
    still_works(group, src, dst)


def test_local_tensor_wrong_dtype_on_one_rank(group, src, dst):
    load(src, dst)
    set_on(src[1], "w", lambda: torch.zeros(4, 8, dtype=torch.float64))
    refused(group, src, dst, good_specs(),
            r"'w' on src rank 1: local 'w' has dtype torch.float64, expected torch.float32")
    still_works(group, src, dst)


def test_local_tensor_wrong_device(group, src, dst):
    load(src, dst)
    set_on(dst[0], "b", lambda: torch.empty(4, device="meta"))
    refused(group, src, dst, good_specs(), r"'b' on dst rank 0: local 'b' is on meta, expected cpu")
    still_works(group, src, dst)


def test_name_missing_on_one_rank(group, src, dst):
    load(src, dst)
    set_on(src[1], "b", lambda: None)
    msg = refused(group, src, dst, good_specs(), r"'b' on src rank 1: no local tensor 'b'")
    assert "src rank 0" not in msg
    still_works(group, src, dst)


def test_local_value_not_a_tensor(group, src, dst):
    load(src, dst)
    set_on(dst[1], "w", lambda: [[0.0] * 4] * 8)
    refused(group, src, dst, good_specs(), r"'w' on dst rank 1: local 'w' is a list, not a tensor")
    still_works(group, src, dst)


def test_slot_outside_its_storage(group, src, dst):
    load(src, dst)
    set_on(dst[0], "fused", lambda: torch.zeros(8, 6))
    set_on(dst[1], "fused", lambda: torch.zeros(8, 6))
    spec = rr.TensorSpec((8, 8), torch.float32, ROWS, COLS,
                         dst_slots={0: rr.Slot("fused", dim=1, offset=2),      # fits
                                    1: rr.Slot("fused", dim=1, offset=4)})     # 4 + 4 > 6
    msg = refused(group, src, dst, good_specs(w=spec),
                  r"'w' on dst rank 1: cannot place shard \(8, 4\) in local 'fused' of shape "
                  r"\(8, 6\)")
    assert "dst rank 0" not in msg
    still_works(group, src, dst)


def test_all_problems_listed_at_once(group, src, dst):
    load(src, dst)
    set_on(src[0], "w", lambda: None)
    set_on(dst[1], "b", lambda: torch.zeros(4, dtype=torch.int32))
    msg = refused(group, src, dst, good_specs(), r"refused before moving any byte")
    assert "'w' on src rank 0: no local tensor 'w'" in msg
    assert "'b' on dst rank 1: local 'b' has dtype torch.int32, expected torch.float32" in msg
    still_works(group, src, dst)


# ------------------------------------------------------------------ specs themselves
def test_mesh_larger_than_actor_list(group, src, dst):
    load(src, dst)
    big = L([0, 1, 2], Shard(0))
    refused(group, src, dst, good_specs(w=rr.TensorSpec((9, 8), torch.float32, big, COLS)),
            r"'w': the src mesh uses rank 2, but the src side has only 2 ranks \(0\.\.1\)")
    refused(group, src, dst, good_specs(b=rr.TensorSpec((8,), torch.float32, REP,
                                                        L([[0, 1], [2, 3]], Shard(0), Replicate()))),
            r"'b': the dst mesh uses rank 3, but the dst side has only 2 ranks")
    still_works(group, src, dst)


def test_empty_spec_set(group, src, dst):
    refused(group, src, dst, {}, r"empty spec set: nothing to refit")


def test_specs_of_the_wrong_type(group, src, dst):
    refused(group, src, dst, [("w", good_specs()["w"])], r"specs must be a mapping", exc=TypeError)
    refused(group, src, dst, {"w": (8, 8)}, r"'w': expected a TensorSpec, got tuple", exc=TypeError)


def test_partial_placement_refused():
    from torch.distributed.tensor import Partial
    with pytest.raises(ValueError, match=r"Partial placements cannot be resharded.*Reduce it first"):
        L([0, 1], Partial())
    fake = types.SimpleNamespace(device_mesh=types.SimpleNamespace(mesh=torch.tensor([0, 1]),
                                                                   mesh_dim_names=("tp",)),
                                 placements=(Partial(),))
    with pytest.raises(ValueError, match=r"Partial placements cannot be resharded"):
        rr.Layout.from_dtensor(fake)


# ------------------------------------------------------------------ constructor arguments
def _groups_in(actors_):
    return ray.get([a.__ray_call__.remote(worker.member_groups) for a in actors_])


@pytest.mark.parametrize("kw, match", [
    ({"bucket_bytes": 0}, r"bucket_bytes must be an int in 1..1073741824 \(1024 MiB\), got 0"),
    ({"bucket_bytes": -4096}, r"bucket_bytes must be an int in 1..1073741824 \(1024 MiB\), got -4096"),
    ({"bucket_bytes": 1.5e6}, r"bucket_bytes must be an int in 1..1073741824 \(1024 MiB\), got 1500000.0"),
    ({"bucket_bytes": "1MB"}, r"bucket_bytes must be an int in 1..1073741824 \(1024 MiB\), got '1MB'"),
    ({"bucket_bytes": True}, r"bucket_bytes must be an int in 1..1073741824 \(1024 MiB\), got True"),
    ({"bucket_bytes": 2 ** 40}, r"bucket_bytes must be an int in 1..1073741824 \(1024 MiB\), got 1099511627776"),
    ({"max_programs": 0}, r"max_programs must be a positive int, got 0"),
    ({"strategy": "ring"}, r"strategy must be one of \('reshard', 'gather_broadcast'\), got 'ring'"),
    ({"backend": "mpi"}, r"backend must be 'auto', 'gloo' or 'nccl', got 'mpi'"),
    ({"backend": "nccl"}, r"backend='nccl' needs every actor on a GPU; processes \[0, 1, 2, 3\] have none"),
    ({"timeout_s": 0}, r"timeout_s must be a positive number of seconds \(or None for the default\), got 0"),
    ({"timeout_s": -1.0}, r"timeout_s must be a positive number of seconds \(or None for the default\), got -1.0"),
])
def test_bad_constructor_arguments(src, dst, kw, match):
    before = _groups_in(src + dst)
    with pytest.raises(ValueError, match=match):
        rr.ReshardGroup(src, dst, **kw)
    assert _groups_in(src + dst) == before           # nothing left behind in the actors


def test_same_actor_twice_on_one_side(src, dst):
    with pytest.raises(ValueError, match=r"src actor 1 is the same actor as src actor 0: each "
                                         r"actor may appear once per side"):
        rr.ReshardGroup([src[0], src[0]], dst)
    with pytest.raises(ValueError, match=r"dst actor 2 is the same actor as dst actor 0"):
        rr.ReshardGroup(src, [dst[0], dst[1], dst[0]])
    with pytest.raises(ValueError, match=r"need at least one source and one destination actor, "
                                         r"got 2 and 0"):
        rr.ReshardGroup(src, [])
    with pytest.raises(TypeError, match=r"expected a Ray actor handle, got str"):
        rr.ReshardGroup(src, ["not an actor"])


def test_bad_refit_timeout(group, src, dst):
    load(src, dst)
    for bad in (0, -1, float("nan")):
        refused(group, src, dst, good_specs(), r"timeout_s must be a positive number of seconds",
                timeout_s=bad)
    still_works(group, src, dst)


# ------------------------------------------------------------------ tensors= callables
def test_tensors_callable_raises(src, dst):
    load(src, dst)

    def lookup(actor):
        if getattr(actor, "rr_test_fail", False):
            raise RuntimeError("checkpoint not loaded yet")
        return actor.tensors

    set_flag = lambda self: setattr(self, "rr_test_fail", True)
    ray.get(dst[1].__ray_call__.remote(set_flag))
    try:
        with rr.ReshardGroup(src, dst, tensors=lookup, timeout_s=20) as g:
            msg = refused(g, src, dst, good_specs(),
                          r"dst rank 1.*tensors\(actor\) raised RuntimeError: checkpoint "
                          r"not loaded yet", exc=rr.RefitError)
            assert "dst rank 0" not in msg and "src rank" not in msg, msg
            ray.get(dst[1].__ray_call__.remote(lambda self: setattr(self, "rr_test_fail", False)))
            still_works(g, src, dst)
    finally:
        ray.get(dst[1].__ray_call__.remote(lambda self: setattr(self, "rr_test_fail", False)))


def test_tensors_callable_returns_non_dict(src, dst):
    load(src, dst)
    with rr.ReshardGroup(src, dst, tensors=lambda actor: list(actor.tensors.values()),
                         timeout_s=20) as g:
        msg = refused(g, src, dst, good_specs(),
                      r"src rank 0.*looking up local tensors failed: TypeError: tensors of Holder "
                      r"must be a dict name -> tensor, got list")
        for who in ("src rank 1", "dst rank 0", "dst rank 1"):
            assert who in msg, msg


def test_actor_without_tensors_method(cluster, src):
    @ray.remote(num_cpus=0)
    class Bare:
        pass

    bare = Bare.options(resources={"node1": 1}).remote()
    load(src, [])
    with rr.ReshardGroup(src, [bare], timeout_s=20) as g:
        spec = {"b": rr.TensorSpec((8,), torch.float32, REP, L([0], Replicate()))}
        with pytest.raises(ValueError, match=r"dst rank 0.*looking up local tensors failed: "
                                             r"TypeError: Bare has no reshard_tensors\(\) method "
                                             r"and the group was built without tensors="):
            g.refit(spec)
    ray.kill(bare)


# ------------------------------------------------------------------ destinations that cannot be written
def test_destination_is_a_parameter_that_requires_grad(group, src, dst):
    """Inference engines and trainers hold nn.Parameters; writing them in place must work."""
    load(src, dst, generation=5)
    for r in range(2):
        shape = tuple(COLS.local_shape(r, (8, 8)))
        set_on(dst[r], "w", lambda shape=shape: torch.nn.Parameter(torch.zeros(shape)))
    group.refit(good_specs())
    got = ray.get([a.get.remote() for a in dst])
    for r in range(2):
        assert torch.equal(got[r]["w"].detach(), rr.shard_tensor(FULL["w"] + 5, COLS, r))


def test_destination_with_overlapping_memory(group, src, dst):
    """An expanded view (stride 0) cannot hold distinct values: refused before any byte moves."""
    load(src, dst)
    set_on(dst[0], "w", lambda: torch.zeros(8, 1).expand(8, 4))
    refused(group, src, dst, good_specs(),
            r"'w' on dst rank 0: its shard in local 'w' \(shape \(8, 4\), strides \(1, 0\)\) "
            r"overlaps itself")
    still_works(group, src, dst)


@pytest.mark.parametrize("strides", [(1, 1), (2, 1), (3, 1)])
def test_destination_overlapping_itself_through_strides(group, src, dst, strides):
    """Strides that make elements share memory without any stride 0 (as_strided): refused."""
    load(src, dst)
    set_on(dst[0], "w", lambda: torch.zeros(64).as_strided((8, 4), strides))
    refused(group, src, dst, good_specs(),
            r"'w' on dst rank 0: its shard in local 'w' .* overlaps itself")
    still_works(group, src, dst)


def test_destination_strided_without_overlap_is_written(group, src, dst):
    """as_strided with gaps but no shared element: accepted and written bit-exactly."""
    load(src, dst)
    set_on(dst[0], "w", lambda: torch.zeros(64).as_strided((8, 4), (7, 1)))
    group.refit(good_specs())
    got = ray.get(dst[0].get.remote())["w"]
    assert got.stride() == (7, 1)
    assert torch.equal(got, rr.shard_tensor(FULL["w"], good_specs()["w"].dst, 0))
    still_works(group, src, dst)


@pytest.mark.parametrize("to", [torch.float4_e2m1fn_x2, torch.uint4, torch.bits8])
def test_dtype_pair_torch_cannot_convert(to):
    """Refused when the spec is made, naming both dtypes: no rank ever starts the refit."""
    with pytest.raises(ValueError, match=rf"torch cannot copy tensors from torch.float32 to "
                                         rf"{to}"):
        rr.TensorSpec((8, 8), to, ROWS, COLS, src_dtype=torch.float32)


def test_bucket_smaller_than_an_element(src, dst):
    with rr.ReshardGroup(src, dst, timeout_s=20, bucket_bytes=2) as g:
        load(src, dst)
        before = snapshot(src + dst)
        with pytest.raises(ValueError, match=r"bucket_bytes=2 is smaller than one element of "
                                             r"'w' \(torch.float32, 4 bytes\)"):
            g.refit(good_specs())
        assert_unchanged(before, snapshot(src + dst))
        assert g.version == 0


def test_two_destination_tensors_sharing_memory(group, src, dst):
    """Two names whose destination shards are the same memory: one would overwrite the other."""
    load(src, dst)
    set_on(dst[0], "b", lambda: torch.zeros(8, 4)[:, 0].clone())

    def alias(self):
        self.tensors["b"] = self.tensors["w"][:4, 0]
    ray.get(dst[0].__ray_call__.remote(alias))
    refused(group, src, dst, good_specs(),
            r"'w' and 'b' on dst rank 0: their local shards share memory")
    still_works(group, src, dst)


# ------------------------------------------------------------------ sizes and planning time
@pytest.mark.parametrize("shape", [(2**40, 2**40), (2**30, 2**30), (1 << 20, 8)],
                         ids=["beyond-int64", "exabytes", "larger-than-held"])
def test_a_shape_larger_than_the_sources_hold_is_refused_at_once(group, src, dst, shape):
    """Sized against what the sources hold before any planning: no time, no driver memory
    spent on buckets of a tensor that cannot exist."""
    import resource
    import time

    load(src, dst)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    big = rr.TensorSpec(shape, torch.float32, ROWS, COLS)
    refused(group, src, dst, good_specs(w=big),
            r"refused before moving any byte: the specs describe \d+ bytes of source tensors, "
            r"but the source processes hold \d+ bytes in all; largest: 'w' "
            + rf"\({shape[0]}, {shape[1]}\) torch.float32")
    assert time.monotonic() - t0 < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 200 * 1024   # KiB
    still_works(group, src, dst)


def test_a_shape_no_tensor_can_hold_is_refused_by_the_planner():
    with pytest.raises(ValueError, match=r"'w': shape \(1099511627776, 1099511627776\) holds "
                                         r"\d+ elements .*more than any tensor can"):
        rr.plan({"w": rr.TensorSpec((2**40, 2**40), torch.float32, ROWS, COLS)})


def test_planning_runs_under_the_refits_deadline(src, dst):
    """A first refit whose planning outlasts its deadline ends in a RefitError saying so."""
    specs = {f"t{i}": rr.TensorSpec((2, 8), torch.float32, ROWS, COLS) for i in range(600)}
    ray.get([a.set.remote({"held": torch.zeros(600 * 8)}) for a in src])
    with rr.ReshardGroup(src, dst) as g:
        with pytest.raises(rr.RefitError, match=r"before moving any byte: the refit's deadline "
                                                r"passed during planning \(\d+ of 600 tensors"):
            g.refit(specs, timeout_s=1e-6)
