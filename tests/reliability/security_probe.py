"""Run by test_security.py in a fresh process (own HOME, no RAY_AUTH_* in the environment):
starts a local Ray cluster with Ray's default configuration, which in Ray 2.60 means token
authentication; runs refits through shared-memory rings; and reports what it saw as one JSON
line ("RESULT {...}"). Not a test module itself.
"""
import json
import os
import re
import subprocess
import sys

import ray
import torch

SEG = re.compile(r"rr-[0-9a-f]{32}")
INTRUDER = "import ray, sys; ray.init(address=sys.argv[1]); print('CONNECTED')"


def mappings(actor):
    """The rr-* segments this process maps: name, file mode, link count (0: unlinked)."""
    seen = {}
    with open("/proc/self/maps") as f:
        for line in f:
            m = SEG.search(line)
            if m and m.group(0) not in seen:
                st = os.stat(f"/proc/self/map_files/{line.split()[0]}")
                seen[m.group(0)] = {"mode": st.st_mode & 0o7777, "uid": st.st_uid,
                                    "nlink": st.st_nlink, "deleted": line.rstrip().endswith("(deleted)")}
    return seen


def auth_in_worker(actor):
    from ray._private.authentication.authentication_utils import is_token_auth_enabled
    return is_token_auth_enabled()


def main():
    import ray_reshard as rr
    from ray_reshard.layout.placement import Replicate, Shard
    from ray_reshard.tools.testing import Holder
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    out = {}
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    out["driver_auth"] = is_token_auth_enabled()
    out["token_file"] = os.path.exists(os.path.expanduser("~/.ray/auth_token"))
    addr = ray.get_runtime_context().gcs_address
    # Clients without the cluster's token, started now (a refused connection takes ~20 s).
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    wrong = subprocess.Popen([sys.executable, "-c", INTRUDER, addr],
                             env=dict(env, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 32,
                                      HOME=os.path.join(os.environ["HOME"], "intruder")),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        src = [Holder.remote()]
        dst = [Holder.remote() for _ in range(3)]
        actors = src + dst
        out["worker_auth"] = ray.get([a.__ray_call__.remote(auth_in_worker) for a in actors])
        L = lambda ranks, *p, names=None: rr.Layout(rr.Mesh(ranks, names), p)
        specs = {"w": rr.TensorSpec((24, 8), torch.float32, L([0], Replicate()),
                                    L([[0, 1, 2]], Replicate(), Shard(0), names=("dp", "tp"))),
                 "r": rr.TensorSpec((3, 5), torch.bfloat16, L([0], Replicate()),
                                    L([[0], [1], [2]], Replicate(), Replicate(), names=("dp", "tp")),
                                    src_dtype=torch.float32)}
        full = {"w": torch.randn(24, 8), "r": torch.randn(3, 5)}
        ray.get(src[0].set.remote({k: v.clone() for k, v in full.items()}))
        ray.get([a.set.remote({k: torch.zeros(s.dst.local_shape(r, s.shape), dtype=s.dtype)
                               for k, s in specs.items()}) for r, a in enumerate(dst)])
        with rr.ReshardGroup(src, dst, bucket_bytes=256, timeout_s=60) as group:
            for _ in range(2):
                group.refit(specs)
            got = ray.get([a.get.remote() for a in dst])
            out["refit_exact"] = all(
                torch.equal(got[r][k], rr.shard_tensor(full[k].to(s.dtype), s.dst, r))
                for k, s in specs.items() for r in range(3))
            out["ring_names"] = group.resources()["segments"]
            out["mapped"] = ray.get([a.__ray_call__.remote(mappings) for a in actors])
            out["in_dev_shm"] = sorted(n for n in out["ring_names"]
                                       if os.path.exists(os.path.join("/dev/shm", n)))
            # Segments straight from a node helper, before they are sealed.
            helper = next(iter(group.resources()["helpers"].values()))
            names = ray.get(helper.create_rings.remote("security-probe", 3, 4096))
            out["helper_names"] = names
            out["helper_files"] = {}
            for n in names:
                st = os.stat(os.path.join("/dev/shm", n))
                out["helper_files"][n] = {"mode": st.st_mode & 0o7777, "uid": st.st_uid}
            out["helper_segments"] = ray.get(helper.segments.remote("security-probe"))
            ray.get(helper.destroy_group.remote("security-probe"))
            out["helper_left"] = [n for n in names if os.path.exists(os.path.join("/dev/shm", n))]
        out["mapped_after_close"] = ray.get([a.__ray_call__.remote(mappings) for a in actors])
        out["uid"] = os.getuid()
    finally:
        try:
            so, se = wrong.communicate(timeout=120)
            out["intruder"] = {"rc": wrong.returncode, "connected": "CONNECTED" in so,
                               "error": (se.strip().splitlines() or [""])[-1][:300]}
        except subprocess.TimeoutExpired:
            wrong.kill()
            out["intruder"] = {"rc": None, "connected": False, "error": "timed out"}
        ray.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
