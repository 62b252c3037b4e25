"""A group outliving its Ray instance: close() raises nothing, garbage collection frees a
dropped group without reporting an error, and nothing reconnects the driver to a new Ray
instance behind the user's back."""
import gc
import sys
import weakref

import pytest
import ray
import torch

import ray_reshard as rr
from ray_reshard.tools.testing import holders

pytestmark = pytest.mark.timeout(120)


def test_close_and_gc_after_ray_shutdown(cluster):
    src, dst = holders(1, 0), holders(1, 1)
    lay = rr.Layout(rr.Mesh([0]), (rr.Replicate(),))
    specs = {"w": rr.TensorSpec((4,), torch.float32, lay, lay)}
    ray.get([src[0].set.remote({"w": torch.ones(4)}), dst[0].set.remote({"w": torch.zeros(4)})])
    closed = rr.ReshardGroup(src, dst, timeout_s=20)
    dropped = rr.ReshardGroup(src, dst, timeout_s=20)
    used = rr.ReshardGroup(src, dst, timeout_s=20)
    assert used.refit(specs).version == 1
    ray.shutdown()
    closed.close()
    closed.close()
    assert not ray.is_initialized()
    gone = weakref.ref(dropped)
    unraisable = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        del dropped
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert gone() is None, "the dropped group is still referenced"
    assert not unraisable, [u.exc_value for u in unraisable]
    assert not ray.is_initialized()         # its finaliser did not reconnect the driver
    with pytest.raises(RuntimeError, match=r"Ray instance this ReshardGroup was built on is gone"):
        used.refit(specs)
    with pytest.raises(RuntimeError, match=r"Ray instance this ReshardGroup was built on is gone"):
        used.update()
    assert not ray.is_initialized()
