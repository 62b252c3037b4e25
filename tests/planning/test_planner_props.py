"""Property tests of the planner: random meshes, placements, shapes, domains, devices, buckets.

Oracle: cut every source rank's shard out of a random full tensor, execute the plan with the
in-process reference executor, and compare every destination shard bit-exactly with the shard
cut from the full tensor (converted to the destination dtype when they differ).

RR_PROP_EXAMPLES=2000 pytest tests/planning/test_planner_props.py   # a longer hunt
"""
from __future__ import annotations

import math
import os
from collections import defaultdict

import numpy as np
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ray_reshard.layout import Layout, Mesh, Replicate, Shard, TensorSpec, shard_tensor
from ray_reshard.planning import plan
from ray_reshard.planning.share import build_share
from ray_reshard.planning.moves import DOMAIN, LOCAL, NETWORK, Endpoint
from ray_reshard.execution.reference import simulate_refit

EXAMPLES = int(os.environ.get("RR_PROP_EXAMPLES", "120"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@st.composite
def meshes(draw, n_ranks: int) -> Mesh:
    """1-3 dims over a random subset of the side's ranks in a random order; sometimes a
    contiguous block (a pipeline stage) instead."""
    ndim = draw(st.integers(1, 3))
    shape = []
    left = n_ranks
    for _ in range(ndim):
        k = draw(st.integers(1, max(1, min(3, left))))
        shape.append(k)
        left //= k
    size = math.prod(shape)
    if size > n_ranks:
        shape = [1] * ndim
        size = 1
    if draw(st.booleans()):
        start = draw(st.integers(0, n_ranks - size))
        ranks = list(range(start, start + size))
    else:
        ranks = draw(st.permutations(list(range(n_ranks))))[:size]
    return Mesh(np.array(ranks).reshape(shape).tolist())


@st.composite
def layouts(draw, n_ranks: int, shape: tuple) -> Layout:
    mesh = draw(meshes(n_ranks))
    options = [Replicate()] + [Shard(d) for d in range(len(shape))]
    pls = [draw(st.sampled_from(options)) for _ in range(mesh.ndim)]
    lay = Layout(mesh, pls)
    # Sometimes a fixed block size (vLLM's padded vocabulary) on one sharded mesh dim
    sharded = [i for i, p in enumerate(pls) if isinstance(p, Shard)]
    if sharded and draw(st.booleans()):
        i = draw(st.sampled_from(sharded))
        d = pls[i].dim
        extent = max([b.sizes[d] for b in Layout(mesh, pls[:i] + [Replicate()] * (len(pls) - i))
                      .boxes(shape).values()], default=0)
        k = mesh.shape[i]
        block = max(1, -(-extent // k)) + draw(st.integers(0, 2))
        pls2 = list(pls)
        pls2[i] = Shard(d, block=block)
        lay2 = Layout(mesh, pls2)
        try:
            lay2.validate_for(shape)
            lay = lay2
        except ValueError:
            pass
    return lay


@st.composite
def side_topology(draw, n: int, ids):
    """(domains, devices) of one side: devices drawn from a pool shared with the other side (a
    shared id = the same device), each device in one domain; or arbitrary domain ids."""
    devices = [draw(ids) for _ in range(n)]
    if draw(st.booleans()):
        domains = [f"dom{d % 3}" for d in devices]
    else:
        domains = [f"dom{draw(st.integers(0, 3))}" for _ in range(n)]
    if draw(st.integers(0, 4)) == 0:           # every rank its own domain / device
        domains = None
    if draw(st.integers(0, 4)) == 0:
        devices = None
    return domains, devices


@st.composite
def problems(draw):
    n_src = draw(st.integers(1, 8))
    n_dst = draw(st.integers(1, 8))
    dev_ids = st.integers(0, 9)
    src_dom, src_dev = draw(side_topology(n_src, dev_ids))
    dst_dom, dst_dev = draw(side_topology(n_dst, dev_ids))
    n_tensors = draw(st.integers(1, 3))
    specs = {}
    for t in range(n_tensors):
        ndim = draw(st.integers(0, 4))
        max_size = {0: 1, 1: 24, 2: 9, 3: 5, 4: 4}[ndim]
        shape = tuple(draw(st.integers(0, max_size)) if draw(st.integers(0, 9)) else 0
                      for _ in range(ndim))
        src = draw(layouts(n_src, shape))
        dst = draw(layouts(n_dst, shape))
        convert = draw(st.booleans())
        dtype = torch.bfloat16 if convert else draw(st.sampled_from(
            [torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.float64]))
        src_dtype = torch.float32 if convert else None
        specs[f"t{t}"] = TensorSpec(shape, dtype, src, dst, src_dtype=src_dtype)
    bucket = draw(st.sampled_from([8, 16, 24, 64, 100, 256, 1 << 20]))
    return dict(specs=specs, n_src=n_src, n_dst=n_dst, src_domains=src_dom, dst_domains=dst_dom,
                src_devices=src_dev, dst_devices=dst_dev, bucket=bucket)


def random_full(shape, dtype, gen) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 100
    if dtype.is_floating_point:
        return x.to(dtype)
    return x.to(torch.int64).to(dtype)


def check_schedule(p, bucket):
    """Buckets fit; a forwarded piece sorts after the network transfer that brought it in."""
    sched = p.schedule(bucket)
    keys = [t.key for t in sched.transfers]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    arrived = defaultdict(list)       # (forwarder dst rank, tensor) -> boxes received so far
    for t in sched.transfers:
        assert t.nbytes == sum(it.box.numel * p.specs[it.tensor].itemsize for it in t.items)
        assert 0 < t.nbytes <= bucket, (t.nbytes, bucket)
        if t.src.side == "dst":
            assert t.path != NETWORK
            for it in t.items:
                assert any(b.contains(it.box) for b in arrived[(t.src.rank, it.tensor)]), (
                    f"forward {t.key} of {it.box} before its network delivery")
        if t.path == NETWORK:
            for it in t.items:
                arrived[(t.dst, it.tensor)].append(it.box)
    # Every process derives its own share, in the same order, from the plan alone: one endpoint
    # per process, and a source and a destination rank sharing a process (colocated).
    topo = p.topology
    procs = [[Endpoint("src", r)] for r in range(topo.n_src)]
    procs += [[Endpoint("dst", r)] for r in range(topo.n_dst)]
    procs += [[Endpoint("src", r), Endpoint("dst", r)] for r in range(min(topo.n_src, topo.n_dst))]
    for eps in procs:
        want = [t for t in sched.transfers if t.src in eps or Endpoint("dst", t.dst) in eps]
        assert build_share(p, eps, bucket) == want, eps


def check_paths(p):
    """Every move's path is where its ends are: a local copy between ranks on one device, a
    domain move inside one domain across devices, a network move between domains."""
    topo = p.topology
    for tp in p.tensor_plans:
        for m in tp.moves:
            side = m.src.side
            sdev = (topo.src_devices if side == "src" else topo.dst_devices)[m.src.rank]
            sdom = (topo.src_domains if side == "src" else topo.dst_domains)[m.src.rank]
            ddev, ddom = topo.dst_devices[m.dst], topo.dst_domains[m.dst]
            if m.path == LOCAL:
                assert sdev == ddev, m
            elif m.path == DOMAIN:
                assert sdom == ddom and sdev != ddev, m
            else:
                assert sdom != ddom, m


def check_stats(p):
    s = p.stats
    assert s.network_bytes == s.min_network_bytes, (s, p.specs)
    per_tensor = 0
    for tp in p.tensor_plans:
        ts = tp.stats
        assert ts.network_bytes == ts.min_network_bytes
        assert sum(b for _, b in ts.send_bytes) == ts.network_bytes
        assert sum(b for _, b in ts.recv_bytes) == ts.network_bytes
        per_tensor += ts.network_bytes
    assert per_tensor == s.network_bytes
    assert s.total_bytes == sum(spec.nbytes for spec in p.specs)


def run_and_compare(pr, seed=0):
    p = plan(pr["specs"], pr["src_domains"], pr["dst_domains"], src_devices=pr["src_devices"],
             dst_devices=pr["dst_devices"], n_src=pr["n_src"], n_dst=pr["n_dst"])
    gen = torch.Generator().manual_seed(seed)
    fulls = {n: random_full(s.shape, s.source_dtype, gen) for n, s in pr["specs"].items()}
    src_store = [dict() for _ in range(pr["n_src"])]
    dst_store = [dict() for _ in range(pr["n_dst"])]
    for name, s in pr["specs"].items():
        for r in s.src.ranks:
            src_store[r][name] = shard_tensor(fulls[name], s.src, r)
        for r in s.dst.ranks:
            shp = s.dst.local_shape(r, s.shape)
            junk = torch.full((math.prod(shp) * s.itemsize,), 0xA5, dtype=torch.uint8)
            dst_store[r][name] = junk.view(s.dtype).reshape(shp)
    moved = simulate_refit(p, src_store, dst_store, bucket_bytes=pr["bucket"])
    for name, s in pr["specs"].items():
        want = fulls[name].to(s.dtype)
        for r in s.dst.ranks:
            got = dst_store[r][name]
            exp = shard_tensor(want, s.dst, r)
            assert got.shape == exp.shape and got.dtype == exp.dtype
            assert torch.equal(bits(got), bits(exp)), (name, r, got, exp)
    st_ = p.stats
    assert moved["network"] == st_.network_bytes
    assert moved["domain"] == st_.domain_bytes and moved["local"] == st_.local_bytes
    return p


@SETTINGS
@given(problems())
def test_simulated_refit_is_bit_exact_and_reaches_the_bound(pr):
    p = run_and_compare(pr)
    check_stats(p)
    check_paths(p)
    check_schedule(p, pr["bucket"])


@SETTINGS
@given(problems(), st.randoms(use_true_random=False))
def test_plan_does_not_depend_on_rank_labels(pr, rnd):
    """Renaming the ranks of both sides (a permutation, with domains and devices carried along)
    renames the plan's statistics and nothing else."""
    p = plan(pr["specs"], pr["src_domains"], pr["dst_domains"], src_devices=pr["src_devices"],
             dst_devices=pr["dst_devices"], n_src=pr["n_src"], n_dst=pr["n_dst"])
    sperm = list(range(pr["n_src"]))
    dperm = list(range(pr["n_dst"]))
    rnd.shuffle(sperm)
    rnd.shuffle(dperm)

    def rename(lay, perm):
        grid = np.array([perm[r] for r in lay.mesh.ranks]).reshape(lay.mesh.shape).tolist()
        return Layout(Mesh(grid, lay.mesh.dim_names), lay.placements)

    def carry(vals, perm):
        if vals is None:
            return None
        out = [None] * len(vals)
        for i, v in enumerate(vals):
            out[perm[i]] = v
        return out

    specs2 = {n: TensorSpec(s.shape, s.dtype, rename(s.src, sperm), rename(s.dst, dperm),
                            src_dtype=s.src_dtype) for n, s in pr["specs"].items()}
    src_dev = carry(pr["src_devices"], sperm) if pr["src_devices"] else None
    dst_dev = carry(pr["dst_devices"], dperm) if pr["dst_devices"] else None
    src_dom = carry(pr["src_domains"], sperm) if pr["src_domains"] else None
    dst_dom = carry(pr["dst_domains"], dperm) if pr["dst_domains"] else None
    # Default ids are per rank index: carry them explicitly so both plans see the same topology.
    if src_dom is None:
        src_dom = carry([("s", i) for i in range(pr["n_src"])], sperm)
    if dst_dom is None:
        dst_dom = carry([("d", i) for i in range(pr["n_dst"])], dperm)
    if src_dev is None:
        src_dev = carry([("s", i) for i in range(pr["n_src"])], sperm)
    if dst_dev is None:
        dst_dev = carry([("d", i) for i in range(pr["n_dst"])], dperm)
    p2 = plan(specs2, src_dom, dst_dom, src_devices=src_dev, dst_devices=dst_dev)
    a, b = p.stats, p2.stats
    for field in ("network_bytes", "domain_bytes", "local_bytes", "min_network_bytes",
                  "gather_broadcast_bytes", "max_send_bytes", "max_recv_bytes", "n_moves"):
        assert getattr(a, field) == getattr(b, field), field
    assert {sperm[r]: v for r, v in p.send_bytes_by_rank.items()} == p2.send_bytes_by_rank
    assert {dperm[r]: v for r, v in p.recv_bytes_by_rank.items()} == p2.recv_bytes_by_rank
