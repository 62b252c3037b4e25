"""GPU paths (skipped without CUDA): packing on the GPU, and a colocated refit over RR_NCCL.

One GPU cannot host NCCL between two ranks, so the runtime test uses one actor on both sides
(local copies on the device, the NCCL group of one process still built and torn down).
"""
import pytest
import torch

import ray_reshard as rr
from ray_reshard.core.placement import Replicate, Shard
from ray_reshard.simulate import simulate_refit

pytestmark = pytest.mark.gpu


def test_pack_unpack_on_gpu_bit_exact():
    src = rr.Layout(rr.Mesh([0, 1, 2, 3]), (Shard(0),))
    dst = rr.Layout(rr.Mesh([[0, 1], [2, 3]]), (Replicate(), Shard(1)))
    full = torch.randn(64, 48, device="cuda")
    spec = rr.TensorSpec(tuple(full.shape), torch.bfloat16, src, dst, src_dtype=torch.float32)
    plan = rr.plan({"w": spec}, src_domains=["a"] * 4, dst_domains=["b", "b", "c", "c"])
    srcs = [{"w": rr.shard_tensor(full, src, r)} for r in range(4)]
    dsts = [{"w": torch.zeros(dst.local_shape(r, full.shape), dtype=torch.bfloat16, device="cuda")}
            for r in range(4)]
    simulate_refit(plan, srcs, dsts, bucket_bytes=1024)
    for r in range(4):
        assert torch.equal(dsts[r]["w"], rr.shard_tensor(full.to(torch.bfloat16), dst, r))


def test_colocated_refit_over_nccl():
    import ray

    ray.init(num_gpus=1, include_dashboard=False)
    try:
        @ray.remote(num_gpus=1, num_cpus=0)
        class Both:
            def __init__(self):
                self.t = {}

            def set(self, t):
                self.t = {k: v.cuda() for k, v in t.items()}

            def get(self):
                return {k: v.cpu() for k, v in self.t.items()}

            def reshard_tensors(self):
                return self.t

        a = Both.remote()
        src = rr.Layout(rr.Mesh([0]), (Replicate(),))
        dst = rr.Layout(rr.Mesh([0]), (Replicate(),))
        full = torch.randn(256, 128)
        spec = rr.TensorSpec(tuple(full.shape), torch.float32, src, dst,
                             dst_slots={0: rr.Slot("out")})
        ray.get(a.set.remote({"w": full, "out": torch.zeros_like(full)}))
        with rr.ReshardGroup([a], [a], backend="nccl") as g:
            res = g.refit({"w": spec})
            assert res.bytes_by_path["local"] == full.numel() * 4
        assert torch.equal(ray.get(a.get.remote())["out"], full)
    finally:
        ray.shutdown()
