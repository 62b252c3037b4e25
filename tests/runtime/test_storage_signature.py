"""A refit reuses the shard views it cut last time only while every local tensor keeps its
memory and layout: each way a trainer or engine can change a tensor in place is seen, with
torch's C++ guards and without them. No Ray."""
from __future__ import annotations

import pytest
import torch

from ray_reshard.runtime import local_check
from ray_reshard.runtime.local_check import StorageSignature


def rebind(t, new):
    t.data = new


CHANGES = {
    "another tensor under the name": lambda st: st.__setitem__("a", torch.zeros(4, 8)),
    "the name gone": lambda st: st.pop("a"),
    "not a tensor any more": lambda st: st.__setitem__("a", None),
    ".data rebound, same shape": lambda st: rebind(st["a"], torch.zeros(4, 8)),
    ".data reshaped in place": lambda st: rebind(st["a"], st["a"].data.view(8, 4)),
    ".data transposed": lambda st: rebind(st["a"], st["a"].data.t()),
    ".data in another dtype": lambda st: rebind(st["a"], st["a"].data.to(torch.bfloat16)),
    "storage freed (FSDP)": lambda st: st["a"].untyped_storage().resize_(0),
    "storage regrown": lambda st: st["a"].untyped_storage().resize_(4 * 8 * 4 * 2),
    "a view's offset moved": lambda st: st.__setitem__("b", st["buf"][1:5]),
}


@pytest.fixture(params=["torch guards", "python"])
def guards(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(local_check, "TensorGuards", None)
    elif local_check.TensorGuards is None:
        pytest.fail("this torch has no torch._C._dynamo.guards.TensorGuards")
    return request.param


def storage() -> dict:
    buf = torch.zeros(16)
    return {"a": torch.nn.Parameter(torch.randn(4, 8)), "b": buf[0:4], "buf": buf}


def test_unchanged_tensors_match(guards):
    st = storage()
    sig = StorageSignature(st, ("a", "b", "buf"))
    assert (sig.guards is not None) == (guards == "torch guards")
    st["a"].data.add_(1.0)              # values change every step: not the signature's business
    assert sig.matches(st)
    assert sig.matches(dict(st))        # a new dict of the same tensors


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_change_in_place_is_seen(guards, change):
    st = storage()
    sig = StorageSignature(st, ("a", "b", "buf"))
    CHANGES[change](st)
    assert not sig.matches(st), change


def test_a_signature_of_one_tensor(guards):
    st = storage()
    sig = StorageSignature(st, ("a",))
    assert sig.matches(st)
    rebind(st["a"], torch.zeros(4, 8))
    assert not sig.matches(st)
    assert not sig.matches({})
