"""Compiled per-process programs: view caching, storage rebinding, merged runs."""
from __future__ import annotations

import torch

from ray_reshard.layout import Layout, Mesh, Replicate, Shard, TensorSpec, shard_tensor
from ray_reshard.planning import plan
from ray_reshard.execution.pack import shard_view
from ray_reshard.planning.moves import Endpoint
from ray_reshard.execution.program import RECV, SEND, compile_program


def _two_ranks():
    """Two tensors sharded on rows over 2 sources, gathered whole on 1 destination."""
    src = Layout(Mesh([0, 1], ("tp",)), (Shard(0),))
    dst = Layout(Mesh([0], ("tp",)), (Replicate(),))
    specs = {"a": TensorSpec((8, 4), torch.float32, src, dst),
             "b": TensorSpec((6, 3), torch.float32, src, dst)}
    return specs, plan(specs, n_src=2, n_dst=1)


def _run(p, specs, src_store, dst_store, programs):
    """Run the compiled programs pairwise (one bucket at a time, in key order)."""
    sends = {s.key: s for prog in programs.values() for s in prog.steps if s.kind == SEND}
    for s in programs[Endpoint("dst", 0)].steps:
        assert s.kind == RECV
        buf = torch.empty(s.nbytes, dtype=torch.uint8)
        sends[s.key].send.pack(buf)
        s.recv.unpack(buf)


def test_views_are_cached_until_a_storage_is_rebound():
    specs, p = _two_ranks()
    fulls = {n: torch.randn(s.shape) for n, s in specs.items()}
    src_store = [{n: shard_tensor(fulls[n], s.src, r).clone() for n, s in specs.items()}
                 for r in range(2)]
    dst_store = [{n: torch.zeros(s.shape) for n, s in specs.items()}]
    stores = {"src": src_store, "dst": dst_store}
    eps = [Endpoint("src", 0), Endpoint("src", 1), Endpoint("dst", 0)]
    programs = {ep: compile_program(p, [ep], 1 << 20) for ep in eps}

    def bind_all():
        return {ep: prog.bind({k: shard_view(p, k[0], k[1], k[2], stores[k[0]][k[1]])
                               for k in prog.held})
                for ep, prog in programs.items()}

    first = bind_all()
    assert all(n > 0 for n in first.values())
    _run(p, specs, src_store, dst_store, programs)
    for n in specs:
        assert torch.equal(dst_store[0][n], fulls[n])
    # Same storages: nothing is rebuilt.
    assert all(n == 0 for n in bind_all().values())
    # A trainer rebinds one parameter's storage (param.data = new tensor): the next bind
    # rebuilds only the parts touching it, and the refit reads the new values.
    new_a = torch.randn(specs["a"].shape)
    src_store[1]["a"] = shard_tensor(new_a, specs["a"].src, 1).clone()
    rebuilt = bind_all()
    assert rebuilt[Endpoint("src", 1)] >= 1 and rebuilt[Endpoint("src", 0)] == 0
    # The destination rebinds too: its new tensor is the one written.
    dst_store[0]["b"] = torch.zeros(specs["b"].shape)
    assert bind_all()[Endpoint("dst", 0)] >= 1
    _run(p, specs, src_store, dst_store, programs)
    want_a = torch.cat([fulls["a"][:4], new_a[4:]])
    assert torch.equal(dst_store[0]["a"], want_a)
    assert torch.equal(dst_store[0]["b"], fulls["b"])


def test_adjacent_contiguous_items_merge_into_one_copy():
    """Two tensors stored back to back in one flat buffer on the source are sent together to a
    destination that stores them back to back too: one copy run per side, not one per item."""
    from ray_reshard.layout.spec import Slot
    src = Layout(Mesh([0], ("tp",)), (Replicate(),))
    dst = Layout(Mesh([0], ("tp",)), (Replicate(),))
    specs = {"a": TensorSpec((4, 4), torch.float32, src, dst,
                             src_slots={0: Slot("flat", index=(0,))},
                             dst_slots={0: Slot("flat", index=(0,))}),
             "b": TensorSpec((4, 4), torch.float32, src, dst,
                             src_slots={0: Slot("flat", index=(1,))},
                             dst_slots={0: Slot("flat", index=(1,))})}
    p = plan(specs, n_src=1, n_dst=1)
    src_flat = torch.randn(2, 4, 4)
    dst_flat = torch.zeros(2, 4, 4)
    sprog = compile_program(p, [Endpoint("src", 0)], 1 << 20)
    dprog = compile_program(p, [Endpoint("dst", 0)], 1 << 20)
    sprog.bind({k: shard_view(p, *k, {"flat": src_flat}) for k in sprog.held})
    dprog.bind({k: shard_view(p, *k, {"flat": dst_flat}) for k in dprog.held})
    (s,), (r,) = sprog.steps, dprog.steps
    assert len(s.send) == 2 and s.send.n_runs == 1 and r.recv.n_runs == 1
    buf = torch.empty(s.nbytes, dtype=torch.uint8)
    s.send.pack(buf)
    r.recv.unpack(buf)
    assert torch.equal(dst_flat, src_flat)


def test_items_of_one_storage_with_a_gap_between_them_are_copied_apart():
    """Two tensors of one flat buffer with a third, not in the refit, between them: two copy
    runs per side, and the bytes between them are neither read nor written."""
    from ray_reshard.layout.spec import Slot
    lay = Layout(Mesh([0], ("tp",)), (Replicate(),))
    specs = {n: TensorSpec((4, 4), torch.float32, lay, lay, src_slots={0: Slot("flat", index=(i,))},
                           dst_slots={0: Slot("flat", index=(i,))})
             for n, i in (("a", 0), ("c", 2))}
    p = plan(specs, n_src=1, n_dst=1)
    src_flat = torch.randn(3, 4, 4)
    dst_flat = torch.full((3, 4, 4), -1.0)
    sprog = compile_program(p, [Endpoint("src", 0)], 1 << 20)
    dprog = compile_program(p, [Endpoint("dst", 0)], 1 << 20)
    sprog.bind({k: shard_view(p, *k, {"flat": src_flat}) for k in sprog.held})
    dprog.bind({k: shard_view(p, *k, {"flat": dst_flat}) for k in dprog.held})
    (s,), (r,) = sprog.steps, dprog.steps
    assert s.send.n_runs == 2 and r.recv.n_runs == 2
    buf = torch.empty(s.nbytes, dtype=torch.uint8)
    s.send.pack(buf)
    r.recv.unpack(buf)
    assert torch.equal(dst_flat[0], src_flat[0]) and torch.equal(dst_flat[2], src_flat[2])
    assert bool((dst_flat[1] == -1.0).all())


def test_bind_with_the_same_token_checks_nothing_and_a_new_token_rebinds():
    """A caller that knows the views are the very objects bound last (same token) skips the
    check; any other token (or none) checks every view as usual."""
    specs, p = _two_ranks()
    prog = compile_program(p, [Endpoint("dst", 0)], 1 << 20)
    shape = lambda k: specs["ab"[k[2]]].shape
    first = {k: torch.zeros(shape(k)) for k in prog.held}
    token = object()
    assert prog.bind(first, token) > 0
    assert prog.bind(first, token) == 0
    second = {k: torch.zeros(shape(k)) for k in prog.held}   # new storage
    assert prog.bind(second, object()) > 0                   # another token: checked, rebuilt
    assert prog.bind(second, None) == 0                      # checked: nothing changed
    assert prog.bind(first, None) > 0
