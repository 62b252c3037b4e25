"""A spec set is refused whenever one of its members alone is refused, with the same error:
validation results cached across the specs of a set (specs sharing layouts and slot rank
tables are checked once) never stand in for a check that depends on what differs between
them, such as where a slot sits in its storage.

RR_PROP_EXAMPLES=2000 pytest tests/layout/test_validation_cache.py   # a longer hunt
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import ray_reshard as rr
from ray_reshard.layout import BlockFP8, Layout, Mesh, Replicate, Shard, Slot, TensorSpec
from ray_reshard.layout.spec import Slots
from ray_reshard.layout.quant import FP8

EXAMPLES = int(os.environ.get("RR_PROP_EXAMPLES", "150"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def outcome(specs) -> str | None:
    """None when `rr.plan` accepts `specs`, else the error as type and text."""
    try:
        rr.plan(specs)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def check_set_against_members(specs) -> None:
    """The set's outcome is its first refused member's, alone (or acceptance when none is)."""
    got = outcome(specs)
    alone = [(name, outcome({name: spec})) for name, spec in specs.items()]
    refused = [(name, err) for name, err in alone if err is not None]
    if got is None:
        assert not refused, f"the set was accepted but {refused[0][0]!r} alone is refused: " \
                            f"{refused[0][1]}"
    else:
        assert refused, f"the set is refused ({got}) but every member alone is accepted"
        assert got == refused[0][1]


def test_fused_gate_up_at_a_ragged_offset_is_refused_in_a_set_as_alone():
    """gate at offset 0 and up at offset 320 of one [gate; up] storage of 640 rows (block
    128): up's scales would start inside gate's last, partial block. The two slot tables
    share their rank tuple (as model recipes build them): up must not reuse gate's result."""
    ranks = (0,)
    src = Layout(Mesh([0]), (Replicate(),))
    dst = Layout(Mesh([0]), (Replicate(),))
    fp8 = BlockFP8((128, 128))

    def spec(offset):
        return TensorSpec((320, 256), FP8, src, dst, src_dtype=torch.bfloat16,
                          dst_slots=Slots.same(ranks, Slot("gate_up", dim=0, offset=offset)),
                          quant=fp8)

    specs = {"gate": spec(0), "up": spec(320)}
    with pytest.raises(ValueError, match=r"'up': destination rank 0 keeps it at offset 320"):
        rr.plan({"up": specs["up"]})
    with pytest.raises(ValueError, match=r"'up': destination rank 0 keeps it at offset 320"):
        rr.plan(specs)
    check_set_against_members(specs)
    check_set_against_members(dict(reversed(specs.items())))


def test_slot_tables_of_one_rank_tuple_with_different_offsets_on_several_ranks():
    """Per-rank slot tables (not one uniform Slot) sharing a rank tuple: rank 1 of the second
    table sits at a ragged offset."""
    ranks = (0, 1)
    src = Layout(Mesh([0, 1]), (Shard(0),))
    dst = Layout(Mesh([0, 1]), (Shard(0),))
    fp8 = BlockFP8((4, 4))
    good = Slots(ranks, None, [Slot("w", dim=0, offset=0), Slot("w", dim=0, offset=4)])
    bad = Slots(ranks, None, [Slot("w", dim=0, offset=8), Slot("w", dim=0, offset=6)])
    a = TensorSpec((8, 8), FP8, src, dst, src_dtype=torch.float32, dst_slots=good, quant=fp8)
    b = TensorSpec((8, 8), FP8, src, dst, src_dtype=torch.float32, dst_slots=bad, quant=fp8)
    assert good.ranks is bad.ranks
    check_set_against_members({"a": a, "b": b})
    with pytest.raises(ValueError, match=r"'b': destination rank 1 keeps it at offset 6"):
        rr.plan({"a": a, "b": b})


# ------------------------------------------------------------------------ the property
SHAPES = [(8, 8), (8, 8), (6, 8), (8, 12), (4, 4), (10, 6)]


@st.composite
def spec_sets(draw):
    """A few specs drawing from small shared pools of shapes, layouts, rank tuples and slot
    tables, so that specs often share what validation caches by identity."""
    src_layouts = [Layout(Mesh([0, 1]), (Shard(0),)), Layout(Mesh([0, 1]), (Replicate(),)),
                   Layout(Mesh([0, 1]), (Shard(1),)), Layout(Mesh([0]), (Replicate(),))]
    dst_layouts = [Layout(Mesh([[0, 1], [2, 3]]), (Replicate(), Shard(0))),
                   Layout(Mesh([0, 1]), (Shard(1),)),
                   Layout(Mesh([0, 1, 2, 3]), (Shard(0),)),
                   Layout(Mesh([0, 1]), (Shard(0, block=4),)),
                   Layout(Mesh([2, 3]), (Replicate(),)),
                   Layout(Mesh([0, 1]), (Shard(0),)),
                   Layout(Mesh([0, 1]), (Shard(2),))]        # refused: the tensors are 2-d
    rank_tuples = [(0, 1), (0, 1), (0, 1, 2, 3), (2, 3), (0, 5)]  # rank 5 is in no mesh
    blocks = [BlockFP8((4, 4)), BlockFP8((2, 4))]
    shared_tables: list = []
    specs = {}
    drawn: list = []
    for i in range(draw(st.integers(1, 5))):
        if drawn and draw(st.booleans()):     # a sibling: all but its slots as an earlier one's
            shape, src, dst, quant, ranks = draw(st.sampled_from(drawn))
        else:
            shape = draw(st.sampled_from(SHAPES))
            src = draw(st.sampled_from(src_layouts))
            dst = draw(st.sampled_from(dst_layouts))
            quant = draw(st.sampled_from([None, *blocks]))
            ranks = draw(st.sampled_from(rank_tuples))
            drawn.append((shape, src, dst, quant, ranks))
        dst_slots = None
        how = draw(st.sampled_from(["none", "uniform", "per_rank", "reuse"]))
        if how == "reuse" and shared_tables:
            dst_slots = draw(st.sampled_from(shared_tables))
        elif how in ("uniform", "per_rank"):
            dim = draw(st.sampled_from([None, 0, 1]))
            offsets = st.sampled_from([0, 4, 8, 2, 6]) if dim is not None else st.just(0)
            if how == "uniform":
                dst_slots = Slots.same(ranks, Slot("w", dim=dim, offset=draw(offsets)))
            else:
                dst_slots = Slots(ranks, None, [Slot("w", dim=dim, offset=draw(offsets))
                                                for _ in ranks])
            shared_tables.append(dst_slots)
        try:
            if quant is None:
                dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
                specs[f"t{i}"] = TensorSpec(shape, dtype, src, dst, dst_slots=dst_slots)
            else:
                specs[f"t{i}"] = TensorSpec(shape, FP8, src, dst, src_dtype=torch.bfloat16,
                                            dst_slots=dst_slots, quant=quant)
        except (ValueError, TypeError):
            continue
    assume(specs)
    return specs


@SETTINGS
@given(spec_sets())
def test_a_set_is_accepted_only_if_every_member_is_and_fails_with_its_members_error(specs):
    """The set in its order and reversed, and every two of its members in both orders."""
    items = list(specs.items())
    check_set_against_members(specs)
    check_set_against_members(dict(reversed(items)))
    for i, a in enumerate(items):
        for b in items[i + 1:]:
            check_set_against_members(dict([a, b]))
            check_set_against_members(dict([b, a]))
