"""Shared helpers of the reliability tests (imported by the test modules next to it)."""
from __future__ import annotations

import os
import re
import sys
import time

import ray
import torch
from ray import cloudpickle

import ray_reshard as rr
from ray_reshard.runtime import worker

SEG_RE = re.compile(r"rr-[0-9a-f]{32}")

# Functions here run inside actors, where tests/ is not importable: ship them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def L(ranks, *placements, names=None):
    return rr.Layout(rr.Mesh(ranks, names), placements)


def fill(src, dst, specs, fulls, dst_seed=0):
    """Sources get their shards of `fulls`; destinations random bits of the right shape."""
    g = torch.Generator().manual_seed(dst_seed)
    per_src = [dict() for _ in src]
    per_dst = [dict() for _ in dst]
    for name, spec in specs.items():
        for r in range(len(src)):
            if spec.src.box(r, spec.shape) is not None:
                per_src[r][name] = rr.shard_tensor(fulls[name].to(spec.source_dtype), spec.src, r)
        for r in range(len(dst)):
            if spec.dst.box(r, spec.shape) is not None:
                per_dst[r][name] = torch.randn(spec.dst.local_shape(r, spec.shape),
                                               generator=g).to(spec.dtype)
    ray.get([a.set.remote(t) for a, t in zip(src, per_src)] +
            [a.set.remote(t) for a, t in zip(dst, per_dst)])


def check_exact(dst, specs, fulls):
    got = ray.get([a.get.remote() for a in dst])
    for name, spec in specs.items():
        want = fulls[name].to(spec.dtype)
        for r, tensors in enumerate(got):
            if spec.dst.box(r, spec.shape) is None:
                continue
            exp = rr.shard_tensor(want, spec.dst, r)
            assert tensors[name].dtype == exp.dtype, (name, r)
            assert torch.equal(tensors[name].view(torch.uint8) if exp.dim() else tensors[name],
                               exp.view(torch.uint8) if exp.dim() else exp), (name, r)


def raw(actors_):
    """Every local tensor of every actor as raw bytes (bit-exact comparisons, NaN-safe)."""
    return ray.get([a.__ray_call__.remote(_raw) for a in actors_])


def _raw(actor):
    return {k: (v.dtype, tuple(v.shape), v.detach().contiguous().reshape(-1).view(torch.uint8).clone())
            for k, v in actor.tensors.items()}


def same_raw(a, b) -> bool:
    if a.keys() != b.keys():
        return False
    return all(a[k][:2] == b[k][:2] and torch.equal(a[k][2], b[k][2]) for k in a)


# ---------------------------------------------------------------- what a process holds
def _state(actor, group_id, group_name):
    from ray.util.collective import collective as col
    maps = open("/proc/self/maps").read()
    return {"pid": os.getpid(),
            "in_groups": group_id in worker.member_groups(actor),
            "groups": worker.member_groups(actor),
            "collective": col.is_group_initialized(group_name),
            "mapped": sorted(set(SEG_RE.findall(maps)))}


def process_state(actors_, group_id, group_name, timeout=30):
    return ray.get([a.__ray_call__.remote(_state, group_id, group_name) for a in actors_],
                   timeout=timeout)


def shm_files():
    return {f for f in os.listdir("/dev/shm") if SEG_RE.fullmatch(f)}


def helper_segments(group_id, helpers):
    """Segments the node helpers (node id -> helper) still hold for `group_id`, by node."""
    return {node: ray.get(h.segments.remote(group_id), timeout=30) for node, h in helpers.items()}


def assert_no_leaks(group_id, group_name, ring_names, helpers, live_actors, deadline_s=15.0):
    """After close()/update(): nothing of the old group stays anywhere we can look."""
    t_end = time.monotonic() + deadline_s
    while True:
        states = process_state(live_actors, group_id, group_name)
        segs = helper_segments(group_id, helpers)
        files = shm_files() & set(ring_names)
        problems = []
        for s in states:
            if s["in_groups"]:
                problems.append(f"pid {s['pid']} still holds state for the group")
            if s["collective"]:
                problems.append(f"pid {s['pid']} still has collective group {group_name}")
            left = set(s["mapped"]) & set(ring_names)
            if left:
                problems.append(f"pid {s['pid']} still maps {sorted(left)}")
        for node, held in segs.items():
            if held:
                problems.append(f"helper on {node[:8]} still holds {held}")
        if files:
            problems.append(f"/dev/shm still has {sorted(files)}")
        if not problems or time.monotonic() > t_end:
            assert not problems, problems
            return
        time.sleep(0.5)
