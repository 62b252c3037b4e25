"""ray.shutdown() from another thread while a refit runs: the refitting thread ends in an
error within seconds (the group's Ray instance is gone), it does not wait out the refit."""
import sys
import threading
import time

import pytest
import ray
import torch
from ray import cloudpickle

import ray_reshard as rr
from ray_reshard.testing import holders

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(120)


def slow_lookup(actor):
    """Destination lookups take 60 s once armed: the refit is still running at shutdown."""
    if getattr(actor, "rr_slow", False):
        time.sleep(60)
    return actor.tensors


@pytest.mark.parametrize("overlapped", [False, True])
def test_shutdown_in_another_thread_ends_the_refit_in_an_error(cluster, overlapped):
    src, dst = holders(1, 0), holders(1, 1)
    lay = rr.Layout(rr.Mesh([0]), (rr.Replicate(),))
    specs = {"w": rr.TensorSpec((4,), torch.float32, lay, lay)}
    ray.get([src[0].set.remote({"w": torch.ones(4)}), dst[0].set.remote({"w": torch.zeros(4)})])
    g = rr.ReshardGroup(src, dst, tensors=slow_lookup, timeout_s=50)
    assert g.refit(specs).version == 1
    ray.get(dst[0].__ray_call__.remote(lambda self: setattr(self, "rr_slow", True)))
    out = {}

    def refit():
        try:
            if overlapped:
                g.refit_async(specs).wait()
            else:
                g.refit(specs)
            out["result"] = "returned"
        except BaseException as e:
            out["error"] = e
        out["at"] = time.monotonic()

    t = threading.Thread(target=refit, daemon=True)
    t.start()
    time.sleep(2.0)                       # the refit waits on the slow destination now
    t0 = time.monotonic()
    ray.shutdown()
    t.join(15)
    assert not t.is_alive(), "the refitting thread is still blocked 15 s after ray.shutdown()"
    assert "error" in out, out
    assert isinstance(out["error"], rr.RefitError), repr(out["error"])
    assert "ray.shutdown()" in str(out["error"])
    assert out["at"] - t0 < 10
    g.close()
    # the module's cluster is still there: reconnect for whoever comes next
    cluster.shutdown()
    from ray_reshard.testing import start_cluster
    start_cluster(2)
