"""A driver that calls ray.shutdown() from another thread while its refit runs, and prints
what the refitting thread saw as one JSON line.

Run as a process of its own (`python shutdown_probe.py ADDRESS OVERLAPPED`): a ray.shutdown()
under a thread that is inside Ray leaves the process's Ray client unfit for a new ray.init(),
so the test that uses it must not share its process with other tests.
"""
import json
import sys
import threading
import time

import ray
import torch

import ray_reshard as rr
from ray_reshard.tools.testing import holders


def slow_lookup(actor):
    """Destination lookups take 60 s once armed: the refit is still running at shutdown."""
    if getattr(actor, "rr_slow", False):
        time.sleep(60)
    return actor.tensors


def main(address: str, overlapped: bool) -> dict:
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    src, dst = holders(1, 0), holders(1, 1)
    lay = rr.Layout(rr.Mesh([0]), (rr.Replicate(),))
    specs = {"w": rr.TensorSpec((4,), torch.float32, lay, lay)}
    ray.get([src[0].set.remote({"w": torch.ones(4)}), dst[0].set.remote({"w": torch.zeros(4)})])
    g = rr.ReshardGroup(src, dst, tensors=slow_lookup, timeout_s=50)
    first = g.refit(specs).version
    ray.get(dst[0].__ray_call__.remote(lambda self: setattr(self, "rr_slow", True)))
    out: dict = {"first_version": first}

    def refit():
        try:
            if overlapped:
                g.refit_async(specs).wait()
            else:
                g.refit(specs)
            out["result"] = "returned"
        except BaseException as e:
            out["error_type"] = type(e).__name__
            out["error"] = str(e)
        out["at"] = time.monotonic()

    t = threading.Thread(target=refit, daemon=True)
    t.start()
    time.sleep(2.0)                       # the refit waits on the slow destination now
    t0 = time.monotonic()
    ray.shutdown()
    t.join(15)
    out["thread_alive"] = t.is_alive()
    if "at" in out:
        out["seconds_after_shutdown"] = out.pop("at") - t0
    g.close()
    out["closed"] = True
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2] == "1")), flush=True)
