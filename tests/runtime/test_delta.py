"""Delta refits on real Ray actors: destinations end bit-identical to a dense refit of the same
weights, for random layouts, dtypes, change densities and failures; every version mismatch
falls back to dense and says so."""
import math
import sys

import pytest
import ray
import torch
from ray import cloudpickle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ray_reshard as rr
from ray_reshard.errors import RefitError
from ray_reshard.execution import delta_host
from ray_reshard.layout.placement import Replicate, Shard
from ray_reshard.tools.testing import Holder

from test_refit import mixed_specs

cloudpickle.register_pickle_by_value(sys.modules[__name__])

DENSITIES = (0.0, 0.001, 0.1, 0.5, 1.0)
FP8 = torch.float8_e4m3fn


# Extra calls on the test actors (`testing.Holder`), run through `__ray_call__`.
def get_bits(actor):
    """Every tensor's bytes (FP8 tensors do not pickle through Ray)."""
    return {k: v.contiguous().reshape(-1).view(torch.uint8) for k, v in actor.tensors.items()}


def zeros(actor, shapes):
    actor.tensors = {k: torch.zeros(s, dtype=dtype) for k, (s, dtype) in shapes.items()}


def poke(actor, name):
    """Change one element of `name` in place (an engine writing behind the refit's back)."""
    t = actor.tensors[name]
    t.view(-1)[0] = t.view(-1)[0] + 1 if t.dtype.is_floating_point else t.view(-1)[0] ^ 1


@pytest.fixture(scope="module")
def actors(cluster):
    # sources on node 0; two destination sets on node 1 (delta, dense) for side-by-side checks
    src = [Holder.options(resources={"node0": 1}).remote() for _ in range(4)]
    d1 = [Holder.options(resources={"node1": 1}).remote() for _ in range(4)]
    d2 = [Holder.options(resources={"node1": 1}).remote() for _ in range(4)]
    ray.get([a.get.remote() for a in src + d1 + d2])
    return src, d1, d2


def random_full(shape, dtype, gen):
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 10
    return x.to(dtype) if dtype.is_floating_point else x.to(torch.int64).to(dtype)


def perturb(fulls, fraction, gen, factor=None):
    """Change `fraction` of the elements of every full tensor (by at least one step of its
    dtype, so a changed element's bytes change; with `factor`, scaled by it instead)."""
    for name, f in fulls.items():
        if f.numel() == 0 or fraction == 0:
            continue
        m = torch.rand(f.shape, generator=gen) < fraction
        if factor is not None:
            f[m] = (f[m].double() * factor).to(f.dtype)
        elif f.dtype.is_floating_point:
            f[m] = (f[m].double() * 1.5 + 1).to(f.dtype)
        else:
            f[m] = f[m] ^ 1


def load_sources(src, specs, fulls):
    per = [dict() for _ in src]
    for name, spec in specs.items():
        for r in spec.src.ranks:
            per[r][name] = rr.shard_tensor(fulls[name].to(spec.source_dtype), spec.src, r)
    ray.get([a.set.remote(t) for a, t in zip(src, per)])


def blank_destinations(dst, specs):
    per = [dict() for _ in dst]
    for name, spec in specs.items():
        for r in spec.dst.ranks:
            shp = spec.dst.local_shape(r, spec.shape)
            junk = torch.full((math.prod(shp) * spec.itemsize,), 0xA5, dtype=torch.uint8)
            per[r][name] = junk.view(spec.dtype).reshape(shp)
    ray.get([a.set.remote(t) for a, t in zip(dst, per)])


def bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bytes(a_actors, b_actors, specs):
    got_a = ray.get([a.get.remote() for a in a_actors])
    got_b = ray.get([a.get.remote() for a in b_actors])
    for name, spec in specs.items():
        for r in spec.dst.ranks:
            assert torch.equal(bits(got_a[r][name]), bits(got_b[r][name])), (name, r)


def expected(dst, specs, fulls):
    got = ray.get([a.get.remote() for a in dst])
    for name, spec in specs.items():
        want = fulls[name].to(spec.dtype)
        for r in spec.dst.ranks:
            assert torch.equal(bits(got[r][name]), bits(rr.shard_tensor(want, spec.dst, r))), \
                (name, r)


# ----------------------------------------------------------------------------- densities
def test_delta_equals_dense_at_every_density(actors):
    src, d1, d2 = actors
    specs, fulls = mixed_specs()
    load_sources(src, specs, fulls)
    blank_destinations(d1, specs)
    blank_destinations(d2, specs)
    gen = torch.Generator().manual_seed(5)
    with rr.ReshardGroup(src, d1) as delta, rr.ReshardGroup(src, d2) as dense:
        first = delta.refit(specs, delta=True)
        assert first.delta["fallbacks"] and all("no baseline yet" in f
                                                for f in first.delta["fallbacks"])
        assert first.delta["network_bytes"] == first.delta["dense_network_bytes"] == \
            first.plan_stats.network_bytes
        assert first.delta["baseline_bytes"] >= first.plan_stats.network_bytes // 4
        for fraction in DENSITIES + (0.1, 0.0):
            perturb(fulls, fraction, gen)
            load_sources(src, specs, fulls)
            res = delta.refit(specs, delta=True)
            dense.refit(specs)
            same_bytes(d1, d2, specs)
            expected(d1, specs, fulls)
            d = res.delta
            assert d["fallbacks"] == []
            assert res.bytes_by_path["network"] == d["network_bytes"]
            assert d["dense_network_bytes"] == res.plan_stats.network_bytes
            if fraction == 0:
                assert d["network_bytes"] == 0 and d["changed_granules"] == 0
                assert set(k for k, v in d["encodings"].items() if v) == {"same"}
            elif fraction <= 0.1:
                assert d["network_bytes"] < 0.6 * d["dense_network_bytes"]
            elif fraction == 1.0:
                assert d["encodings"]["dense"] > 0 and \
                    d["network_bytes"] <= d["dense_network_bytes"]


# ----------------------------------------------------------------------------- fallbacks
def simple_specs(n=3, dtype=torch.bfloat16):
    tp4 = rr.Layout(rr.Mesh([0, 1, 2, 3]), (Shard(0),))
    dst = rr.Layout(rr.Mesh([[0, 1], [2, 3]], ("dp", "tp")), (Replicate(), Shard(1)))
    specs = {f"w{i}": rr.TensorSpec((64, 96), dtype, tp4, dst, src_dtype=torch.float32)
             for i in range(n)}
    gen = torch.Generator().manual_seed(n)
    return specs, {k: torch.randn(s.shape, generator=gen) for k, s in specs.items()}


def step(group, src, specs, fulls, gen, fraction=0.05, **kw):
    perturb(fulls, fraction, gen)
    load_sources(src, specs, fulls)
    return group.refit(specs, delta=True, **kw)


def test_fallbacks_on_every_version_mismatch(actors):
    src, d1, _ = actors
    specs, fulls = simple_specs()
    other = {"w0": specs["w0"]}
    load_sources(src, specs, fulls)
    blank_destinations(d1, specs)
    gen = torch.Generator().manual_seed(1)
    with rr.ReshardGroup(src, d1, max_programs=1) as g:
        assert step(g, src, specs, fulls, gen).delta["fallbacks"]          # no baseline yet
        assert step(g, src, specs, fulls, gen).delta["fallbacks"] == []
        # a dense refit in between: receivers hold a version the baselines do not
        perturb(fulls, 0.05, gen)
        load_sources(src, specs, fulls)
        g.refit(specs)
        res = step(g, src, specs, fulls, gen)
        assert res.delta["fallbacks"] and all("the baseline is v" in f
                                              for f in res.delta["fallbacks"])
        expected(d1, specs, fulls)
        assert step(g, src, specs, fulls, gen).delta["fallbacks"] == []
        # another spec set evicts the program (max_programs=1): its baselines go with it
        g.refit(other, delta=True)
        res = step(g, src, specs, fulls, gen)
        assert any("no baseline yet" in f for f in res.delta["fallbacks"])
        expected(d1, specs, fulls)
        # a refused refit moves nothing: the next delta still applies
        assert step(g, src, specs, fulls, gen).delta["fallbacks"] == []
        bad = dict(specs)
        bad["w9"] = specs["w0"]                    # no such local tensor anywhere
        with pytest.raises(ValueError):
            g.refit(bad, delta=True)
        res = step(g, src, specs, fulls, gen)
        # the failed spec set evicted this program too (max_programs=1)
        res = step(g, src, specs, fulls, gen)
        assert res.delta["fallbacks"] == []
        expected(d1, specs, fulls)
        # update(): a new collective group, no baselines, receivers of unknown version
        g.update()
        res = step(g, src, specs, fulls, gen)
        assert res.delta["fallbacks"]
        expected(d1, specs, fulls)
        # atomic delta refits apply onto staged copies of what destinations hold
        res = step(g, src, specs, fulls, gen, atomic=True)
        assert res.delta["fallbacks"] == [] and res.delta["network_bytes"] > 0
        expected(d1, specs, fulls)
        assert g.versions() == [g.version] * len(g.versions())


def test_destination_changed_outside_refits_is_caught(actors):
    """A destination written outside refits fails the delta refit that finds it (RefitError
    naming the receiver); no member was lost, so the group stays usable without update(): the
    next refit of any kind works, delta ones dense where a receiver's bytes are unknown."""
    src, d1, _ = actors
    specs, fulls = simple_specs(2)
    load_sources(src, specs, fulls)
    blank_destinations(d1, specs)
    gen = torch.Generator().manual_seed(2)
    with rr.ReshardGroup(src, d1) as g:
        step(g, src, specs, fulls, gen)
        step(g, src, specs, fulls, gen)
        # an engine rewrote a weight behind our back (in every destination: a replica written
        # by a forward from another is repaired, the one receiving from the network notices)
        ray.get([a.__ray_call__.remote(poke, "w1") for a in d1])
        with pytest.raises(RefitError, match=r"changed outside refits") as e:
            step(g, src, specs, fulls, gen, fraction=0.0)
        assert "stays usable" in str(e.value)
        assert e.value.failed_ranks and all(side == "dst" for side, _ in e.value.failed_ranks)
        assert set(g.stale_destinations()) == {0, 1, 2, 3}      # not atomic: all unknown
        res = step(g, src, specs, fulls, gen)                    # no update() in between
        assert res.delta["fallbacks"] and res.delta["mismatches"] == []
        assert not res.warnings                                  # nothing was re-formed
        expected(d1, specs, fulls)
        assert g.stale_destinations() == {}
        res = step(g, src, specs, fulls, gen)
        assert res.delta["fallbacks"] == []
        expected(d1, specs, fulls)
        # atomic: only the receiver that changed is unknown, the others keep their weights;
        # a dense refit, then refit_async delta refits, work at once
        step(g, src, specs, fulls, gen, atomic=True)
        ray.get(d1[0].__ray_call__.remote(poke, "w0"))
        held = ray.get([a.get.remote() for a in d1[1:]])
        with pytest.raises(RefitError, match=r"changed outside refits") as e:
            step(g, src, specs, fulls, gen, atomic=True)
        assert ("dst", 0) in e.value.failed_ranks and 0 in g.stale_destinations()
        for a, before in zip(d1[1:], held):
            after = ray.get(a.get.remote())
            assert all(torch.equal(bits(before[k]), bits(after[k])) for k in before)
        perturb(fulls, 0.05, gen)
        load_sources(src, specs, fulls)
        g.refit(specs)
        expected(d1, specs, fulls)
        first = g.refit_async(specs, delta=True).wait()         # after a dense refit: dense
        res = g.refit_async(specs, delta=True).wait()
        assert first.delta["fallbacks"] and res.delta["fallbacks"] == []
        assert res.delta["network_bytes"] == 0
        expected(d1, specs, fulls)
        assert g.versions() == [g.version] * len(g.versions())


def test_host_baselines_and_refit_async(actors):
    src, d1, d2 = actors
    specs, fulls = simple_specs(2, torch.float32)
    load_sources(src, specs, fulls)
    blank_destinations(d1, specs)
    blank_destinations(d2, specs)
    gen = torch.Generator().manual_seed(4)
    with rr.ReshardGroup(src, d1, delta_baseline="host") as g, \
            rr.ReshardGroup(src, d2) as dense:
        for _ in range(3):
            perturb(fulls, 0.02, gen)
            load_sources(src, specs, fulls)
            res = g.refit_async(specs, delta=True).wait()
            dense.refit(specs)
            same_bytes(d1, d2, specs)
        assert res.delta["fallbacks"] == [] and res.delta["baseline_bytes"] > 0
        assert res.delta["network_bytes"] < res.delta["dense_network_bytes"] / 2
        flat = res.to_dict()
        assert flat["delta_network_bytes"] == res.delta["network_bytes"] == flat["network_bytes"]
        assert flat["delta_fallbacks"] == 0 and flat["delta_mask_buckets"] + \
            flat["delta_index_buckets"] + flat["delta_same_buckets"] > 0
    with pytest.raises(ValueError, match="delta_baseline"):
        rr.ReshardGroup(src, d1, delta_baseline="disk")


def test_delta_needs_the_reshard_strategy(actors):
    src, d1, _ = actors
    specs, fulls = simple_specs(1)
    with rr.ReshardGroup(src, d1, strategy="gather_broadcast") as g:
        with pytest.raises(ValueError, match="reshard strategy"):
            g.refit(specs, delta=True)


def test_fp8_blocks_as_deltas_and_widened_tensors_dense(actors):
    """Block-FP8 destinations: sender-quantised blocks travel as deltas of their FP8 bytes and
    scales; a tensor whose source shards cut blocks (quantised on arrival) always dense."""
    src, d1, d2 = actors
    g = torch.Generator().manual_seed(3)
    full = (torch.randn(256, 128, generator=g) * 0.02).to(torch.bfloat16)
    cut = (torch.randn(96, 128, generator=g) * 0.02).to(torch.bfloat16)
    q = rr.BlockFP8((16, 16))
    src2 = rr.Layout(rr.Mesh([0, 1]), (Shard(0),))
    src3 = rr.Layout(rr.Mesh([0, 1, 2, 3]), (Shard(0),))    # 24-row shards cut 16-row blocks
    dst = rr.Layout(rr.Mesh([[0, 1], [2, 3]], ("dp", "tp")), (Replicate(), Shard(1)))
    specs = {"w": rr.TensorSpec(full.shape, FP8, src2, dst, src_dtype=torch.bfloat16, quant=q),
             "c": rr.TensorSpec(cut.shape, FP8, src3, dst, src_dtype=torch.bfloat16, quant=q)}
    fulls = {"w": full, "c": cut}

    def blank(actors_):
        per = []
        for r in range(4):
            t = {}
            for k, f in fulls.items():
                local = dst.local_shape(r, f.shape)
                t[k] = (local, FP8)
                t[k + "_scale_inv"] = (q.scale_shape(local), torch.float32)
            per.append(t)
        ray.get([a.__ray_call__.remote(zeros, t) for a, t in zip(actors_, per)])

    load_sources(src, specs, fulls)
    blank(d1)
    blank(d2)
    gen = torch.Generator().manual_seed(6)
    with rr.ReshardGroup(src, d1) as delta, rr.ReshardGroup(src, d2) as dense:
        for name in ("w", "c"):          # one tensor per spec set: buckets mix tensors
            one = {name: specs[name]}
            delta.refit(one, delta=True)
            dense.refit(one)
            for fraction in (0.0, 0.01, 1.0, 0.01):
                # shrinking a few elements leaves most blocks' scales (their largest element)
                perturb(fulls, fraction, gen, factor=0.8)
                load_sources(src, specs, fulls)
                res = delta.refit(one, delta=True)
                dense.refit(one)
                a = ray.get([x.__ray_call__.remote(get_bits) for x in d1])
                b = ray.get([x.__ray_call__.remote(get_bits) for x in d2])
                for r in range(4):
                    for k in (name, name + "_scale_inv"):
                        assert torch.equal(a[r][k], b[r][k]), (k, r, fraction)
                d = res.delta
                if name == "c":
                    assert d["network_bytes"] == d["dense_network_bytes"] > 0
                elif fraction == 0.0:
                    assert d["network_bytes"] == 0
                elif fraction == 0.01:
                    assert 0 < d["network_bytes"] < d["dense_network_bytes"]


# ----------------------------------------------------------------------------- property
@st.composite
def layouts(draw, n_ranks: int, shape: tuple):
    """A 1-2 dim mesh over some of the side's ranks (in any order), each dim replicating or
    sharding a dim of the tensor."""
    ranks = draw(st.permutations(list(range(n_ranks))))
    k = draw(st.integers(1, n_ranks))
    ranks = ranks[:k]
    if k % 2 == 0 and k > 2 and draw(st.booleans()):
        mesh = rr.Mesh([ranks[:k // 2], ranks[k // 2:]])
    else:
        mesh = rr.Mesh(ranks)
    options = [Replicate()] + [Shard(d) for d in range(len(shape))]
    return rr.Layout(mesh, [draw(st.sampled_from(options)) for _ in range(mesh.ndim)])


@st.composite
def problems(draw):
    n_src = draw(st.integers(1, 4))
    n_dst = draw(st.integers(1, 4))
    specs = {}
    for t in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.integers(1, {1: 40, 2: 12, 3: 6}[ndim])) for _ in range(ndim))
        convert = draw(st.booleans())
        dtype = torch.bfloat16 if convert else draw(st.sampled_from(
            [torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.float64]))
        specs[f"t{t}"] = rr.TensorSpec(shape, dtype, draw(layouts(n_src, shape)),
                                       draw(layouts(n_dst, shape)),
                                       src_dtype=torch.float32 if convert else None)
    dst_domains = draw(st.sampled_from([None, "pairs", "one"]))
    densities = draw(st.lists(st.sampled_from(DENSITIES), min_size=2, max_size=4))
    failure = draw(st.sampled_from(["none", "dense", "refused", "timeout", "update"]))
    at = draw(st.integers(0, len(densities) - 1))
    bucket = draw(st.sampled_from([64, 256, 1 << 20]))
    return dict(specs=specs, n_src=n_src, n_dst=n_dst, dst_domains=dst_domains,
                densities=densities, failure=failure, at=at, bucket=bucket,
                seed=draw(st.integers(0, 1000)))


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(problems())
def test_random_delta_refits_equal_dense(actors, pr):
    random_case(actors, pr)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(problems())
def test_random_delta_refits_equal_dense_longer(actors, pr):
    random_case(actors, pr)


def random_case(actors, pr):
    """Delta refits of a random problem through its densities (and a failure between two of
    them) leave the same bytes as dense refits into the other destinations."""
    src, d1, d2 = actors
    src, d1, d2 = src[:pr["n_src"]], d1[:pr["n_dst"]], d2[:pr["n_dst"]]
    specs = pr["specs"]
    gen = torch.Generator().manual_seed(pr["seed"])
    fulls = {n: random_full(s.shape, s.source_dtype, gen) for n, s in specs.items()}
    domains = {None: None, "pairs": [f"d{r // 2}" for r in range(pr["n_dst"])],
               "one": ["d0"] * pr["n_dst"]}[pr["dst_domains"]]
    load_sources(src, specs, fulls)
    blank_destinations(d1, specs)
    blank_destinations(d2, specs)
    with rr.ReshardGroup(src, d1, bucket_bytes=pr["bucket"], dst_domains=domains) as delta, \
            rr.ReshardGroup(src, d2, bucket_bytes=pr["bucket"]) as dense:
        for i, fraction in enumerate(pr["densities"]):
            perturb(fulls, fraction, gen)
            load_sources(src, specs, fulls)
            if i == pr["at"] and pr["failure"] != "none":
                fail(delta, specs, pr["failure"], d1)
            delta.refit(specs, delta=True)
            dense.refit(specs)
            same_bytes(d1, d2, specs)


def fail(group, specs, how, dst):
    """Something between two delta refits that breaks the version chain (or does not)."""
    if how == "dense":
        group.refit(specs)
    elif how == "refused":
        bad = {"nope": next(iter(specs.values())), **specs}
        with pytest.raises(ValueError):
            group.refit(bad, delta=True)
    elif how == "timeout":        # fails somewhere in install, check or transfer
        try:
            group.refit(specs, delta=True, timeout_s=0.05)
        except RefitError:
            group.update()
    elif how == "update":
        group.update()


def test_partial_refits_keep_their_own_baselines(actors):
    """A refit of some of the names is its own spec set with its own baselines: repeated
    partial delta refits apply as deltas; a whole refit in between sends the next one dense."""
    src, d1, d2 = actors
    specs, fulls = simple_specs(3)
    part = {k: specs[k] for k in ("w0", "w2")}
    load_sources(src, specs, fulls)
    blank_destinations(d1, specs)
    gen = torch.Generator().manual_seed(8)
    with rr.ReshardGroup(src, d1) as g:
        g.refit(specs, delta=True)
        first = step(g, src, part, fulls, gen)
        assert first.delta["fallbacks"]                 # its own first: no baseline yet
        for _ in range(2):
            res = step(g, src, part, fulls, gen, fraction=0.02)
            assert res.delta["fallbacks"] == []
            assert 0 < res.delta["network_bytes"] < res.delta["dense_network_bytes"] / 2
        res = step(g, src, specs, fulls, gen)       # the whole set: its baseline is older
        assert res.delta["fallbacks"]
        whole = {k: v.clone() for k, v in fulls.items()}
        res = step(g, src, part, fulls, gen)
        assert res.delta["fallbacks"]
        expected(d1, part, fulls)
        expected(d1, {"w1": specs["w1"]}, whole)      # the names left out stay as they were


def test_deltas_for_some_names_only(actors):
    """`delta=names` (an engine's parameters read in place): buckets of those tensors travel
    as deltas, any other bucket dense, keeping no baseline; destinations equal a dense group's.
    Names not in the specs, or a string, are refused before anything moves."""
    src, d1, d2 = actors
    specs, _ = simple_specs(3)
    specs = {k: rr.TensorSpec((256, 96), s.dtype, s.src, s.dst, src_dtype=s.source_dtype)
             for k, s in specs.items()}          # items larger than a bucket: one tensor each
    fulls = {k: torch.randn(s.shape, generator=torch.Generator().manual_seed(1))
             for k, s in specs.items()}
    load_sources(src, specs, fulls)
    blank_destinations(d1, specs)
    blank_destinations(d2, specs)
    gen = torch.Generator().manual_seed(9)
    with rr.ReshardGroup(src, d1, bucket_bytes=4096) as g, rr.ReshardGroup(src, d2) as dense:
        for delta in (["w0"], ["w0"], True, True):
            perturb(fulls, 0.02, gen)
            load_sources(src, specs, fulls)
            res = g.refit(specs, delta=delta)
            dense.refit(specs)
            same_bytes(d1, d2, specs)
            if delta == ["w0"] and res.delta["fallbacks"] == []:
                enc = res.delta["encodings"]
                assert enc["dense"] > 0 and enc["mask"] + enc["index"] > 0
                only_w0 = res.delta["baseline_bytes"]
        assert res.delta["fallbacks"] == [] and res.delta["encodings"]["dense"] == 0
        assert only_w0 < res.delta["baseline_bytes"]
        with pytest.raises(ValueError, match="not in this refit"):
            g.refit(specs, delta=["w0", "nope"])
        with pytest.raises(TypeError, match="collection of spec names"):
            g.refit(specs, delta="w0")
        assert g.refit(specs, delta=[]).delta is None          # nothing named: dense
        expected(d1, specs, fulls)


def test_first_delta_refit_does_not_pay_for_the_codec_build(cluster, tmp_path):
    """Fresh processes on a host whose delta codec is not built yet, with a slow compiler:
    the first delta refit builds it under the group's setup timeout, before its own deadline
    starts, so a short `timeout_s` still holds; later delta refits build nothing."""
    cxx = tmp_path / "slow-cxx"
    cxx.write_text('#!/bin/sh\n[ "$1" = --version ] || sleep 3\nexec g++ "$@"\n')
    cxx.chmod(0o755)
    env = {"env_vars": {"CXX": str(cxx), "RAY_RESHARD_KERNEL_CACHE": str(tmp_path / "cache")}}
    src = [Holder.options(resources={"node0": 1}, runtime_env=env).remote() for _ in range(4)]
    dst = [Holder.options(resources={"node1": 1}, runtime_env=env).remote() for _ in range(4)]
    specs, fulls = simple_specs()
    load_sources(src, specs, fulls)
    blank_destinations(dst, specs)
    built = lambda actor: delta_host.loaded()
    try:
        with rr.ReshardGroup(src, dst) as g:
            assert not any(ray.get([a.__ray_call__.remote(built) for a in src + dst]))
            g.refit(specs, timeout_s=2.0)            # a dense refit builds no codec
            assert not any(ray.get([a.__ray_call__.remote(built) for a in src + dst]))
            res = g.refit(specs, delta=True, timeout_s=2.0)
            assert res.delta["fallbacks"]            # the first: dense, no baseline yet
            assert all(ray.get([a.__ray_call__.remote(built) for a in src + dst]))
            expected(dst, specs, fulls)
            perturb(fulls, 0.1, torch.Generator().manual_seed(3))
            load_sources(src, specs, fulls)
            res = g.refit(specs, delta=True, timeout_s=2.0)
            assert res.delta["fallbacks"] == []
            expected(dst, specs, fulls)
    finally:
        for a in src + dst:
            ray.kill(a)
