"""GPU paths. The rules they follow (backend choice, which device opens a peer's CUDA IPC buffer,
allocator settings, NVML's fabric structs, message order of the raw transfer) are plain functions
tested here on any machine; the tests that need CUDA are marked `gpu` (skipped without it, run in
the full suite on a GPU machine)."""
from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ray_reshard as rr
from ray_reshard.layout.placement import Replicate, Shard
from ray_reshard.runtime.node_helper import (FabricInfo, FabricInfoV2, fabric_domain_of,
                                             gpu_inventory)
from ray_reshard.runtime.transport.devices import (choose_backend, expandable_segments,
                                                   ipc_open_device, shared_gpus)
from ray_reshard.runtime.worker import raw_ops
from ray_reshard.execution.reference import simulate_refit

ROOT = Path(__file__).resolve().parents[2]


# ---- anywhere ------------------------------------------------------------------------------

def test_auto_picks_nccl_only_with_one_process_per_gpu():
    assert choose_backend("auto", ["GPU-a", "GPU-b", "GPU-c"]) == "nccl"
    # fractional num_gpus: two processes on GPU-a -> no NCCL (it refuses two ranks on one GPU)
    assert choose_backend("auto", ["GPU-a", "GPU-a", "GPU-b"]) == "gloo"
    assert choose_backend("auto", [None, None]) == "gloo"
    assert choose_backend("auto", ["GPU-a", None]) == "gloo"
    assert choose_backend("gloo", ["GPU-a", "GPU-b"]) == "gloo"
    assert shared_gpus(["GPU-a", "GPU-b", "GPU-a", None, None]) == {"GPU-a": [0, 2]}


def test_nccl_refused_clearly_for_shared_gpus_and_cpu_processes():
    with pytest.raises(ValueError, match=r"processes \[0, 2\] share GPU GPU-a"):
        choose_backend("nccl", ["GPU-a", "GPU-b", "GPU-a"])
    with pytest.raises(ValueError, match=r"processes \[1\] have none"):
        choose_backend("nccl", ["GPU-a", None])
    with pytest.raises(ValueError, match="backend must be"):
        choose_backend("mpi", ["GPU-a"])


def test_ipc_buffer_of_an_invisible_gpu_opens_on_the_own_device():
    # Ray's per-actor CUDA_VISIBLE_DEVICES: the sender sees only its own GPU (index 0)
    assert ipc_open_device("GPU-peer", ["GPU-mine"], current=0) == 0
    # both visible (all GPUs visible, or the same GPU shared): the buffer's own index
    assert ipc_open_device("GPU-peer", ["GPU-mine", "GPU-peer"], current=0) == 1
    assert ipc_open_device("GPU-mine", ["GPU-mine"], current=0) == 0
    assert ipc_open_device(None, ["GPU-mine", "GPU-x"], current=1) == 1


def test_expandable_segments_setting_is_read_like_torch():
    assert not expandable_segments(None)
    assert not expandable_segments("")
    assert expandable_segments("expandable_segments:True")
    assert expandable_segments("max_split_size_mb:128, expandable_segments:True")
    assert not expandable_segments("expandable_segments:True,expandable_segments:False")
    assert not expandable_segments("garbage_collection_threshold:0.6")


def test_nvml_fabric_structs_match_nvml_h():
    # nvml.h: nvmlGpuFabricInfo_t {uchar clusterUuid[16]; int status; uint cliqueId; uchar state}
    assert (FabricInfo.status.offset, FabricInfo.cliqueId.offset, FabricInfo.state.offset) == \
        (16, 20, 24)
    assert ctypes.sizeof(FabricInfo) == 28
    # nvmlGpuFabricInfo_v2_t, whose version id nvml.h defines as 0x02000024
    assert ctypes.sizeof(FabricInfoV2) | (2 << 24) == 0x02000024
    assert (FabricInfoV2.clusterUuid.offset, FabricInfoV2.state.offset,
            FabricInfoV2.healthMask.offset) == (4, 28, 32)


def test_fabric_domain_read_through_the_c_structs(monkeypatch):
    """A stand-in for NVML's C library (no NVML here) that writes what the driver would."""
    uuid = bytes(range(1, 17))

    class FakeNvml:
        calls = []

        @staticmethod
        def _nvmlGetFunctionPointer(name):
            def fn(handle, ref):
                FakeNvml.calls.append(name)
                info = ref._obj
                if name == "nvmlDeviceGetGpuFabricInfoV":
                    if info.version != 0x02000024:
                        return 25                # NVML_ERROR_ARGUMENT_VERSION_MISMATCH
                ctypes.memmove(ctypes.addressof(info.clusterUuid), uuid, 16)
                info.status, info.cliqueId, info.state = 0, 7, 3
                return 0
            return fn

        nvmlInit = nvmlShutdown = staticmethod(lambda: None)
        nvmlDeviceGetCount = staticmethod(lambda: 1)
        nvmlDeviceGetHandleByIndex = staticmethod(lambda i: i)
        nvmlDeviceGetUUID = staticmethod(lambda h: "GPU-0000")

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml)
    inv = gpu_inventory()
    assert inv == [{"index": 0, "uuid": "GPU-0000", "fabric": f"nvl-{uuid.hex()}-7"}]
    assert FakeNvml.calls == ["nvmlDeviceGetGpuFabricInfoV"]
    assert fabric_domain_of(uuid, 0, 7, 2) is None            # registration not complete
    assert fabric_domain_of(bytes(16), 0, 7, 3) is None       # no cluster
    assert fabric_domain_of(uuid, 1, 7, 3) is None            # an error status


def test_raw_transfer_orders_match_on_both_ends():
    chunk, n = 4, 10
    a = raw_ops(0, {1: 1}, {1: 1}, n, chunk)
    b = raw_ops(1, {0: 1}, {0: 1}, n, chunk)
    # the lower process sends first, the higher receives first: op i of one end matches op i
    # of the other (a lock-step transport would deadlock if both received first)
    assert [k for k, _, _ in a] == ["s"] * 3 + ["r"] * 3
    assert [(k == "s", m) for k, _, m in a] == [(k == "r", m) for k, _, m in b]


def test_gpu_smoke_script_dry_run():
    out = subprocess.run([sys.executable, str(ROOT / "release_tests" / "gpu_smoke.py"),
                          "--cpu-dry-run", "--time-limit", "240"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = [ln for ln in out.stdout.splitlines() if ln[:4] in ("PASS", "FAIL", "SKIP")]
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    steps = {ln.split()[1]: ln.split()[0] for ln in lines[:-1]}
    assert steps["ipc_refit_shared_gpu"] == steps["rank_fails_mid_refit"] == "PASS", lines
    assert steps["nccl"] == "SKIP" and "refused on CPU" in out.stdout
    assert lines[-1].startswith("PASS")


# ---- GPU -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_ray():
    """A private Ray instance with this machine's GPUs (never someone else's CPU cluster)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_gpus=torch.cuda.device_count(), include_dashboard=False,
             log_to_driver=False)
    yield ray
    ray.shutdown()


def _gpu_holder():
    import ray

    @ray.remote(num_cpus=0)
    class GpuHolder:
        def __init__(self):
            self.t = {}

        def set(self, t):
            self.t = {k: v.cuda() for k, v in t.items()}

        def get(self):
            return {k: v.cpu() for k, v in self.t.items()}

        def reshard_tensors(self):
            return self.t
    return GpuHolder


@pytest.mark.gpu
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


@pytest.mark.gpu
def test_colocated_refit_over_nccl(gpu_ray):
    ray = gpu_ray
    a = _gpu_holder().options(num_gpus=0.5).remote()
    src = rr.Layout(rr.Mesh([0]), (Replicate(),))
    full = torch.randn(256, 128)
    spec = rr.TensorSpec(tuple(full.shape), torch.float32, src, src,
                         dst_slots={0: rr.Slot("out")})
    try:
        ray.get(a.set.remote({"w": full, "out": torch.zeros_like(full)}))
        with rr.ReshardGroup([a], [a], backend="nccl") as g:
            res = g.refit({"w": spec})
            assert res.bytes_by_path["local"] == full.numel() * 4
        assert torch.equal(ray.get(a.get.remote())["out"], full)
    finally:
        ray.kill(a)             # frees its share of the GPU for the next test


@pytest.mark.gpu
def test_actors_sharing_one_gpu_refit_over_cuda_ipc(gpu_ray):
    """Fractional num_gpus: no NCCL, CUDA IPC rings, bit-exact, dtype converted on the GPU."""
    ray = gpu_ray
    holder = _gpu_holder()
    src = [holder.options(num_gpus=0.2).remote() for _ in range(2)]
    dst = [holder.options(num_gpus=0.2).remote() for _ in range(2)]
    s_l = rr.Layout(rr.Mesh([0, 1]), (Shard(0),))
    d_l = rr.Layout(rr.Mesh([0, 1]), (Shard(1),))
    full = torch.randn(512, 256)
    specs = {"w": rr.TensorSpec((512, 256), torch.bfloat16, s_l, d_l, src_dtype=torch.float32)}
    try:
        for r, a in enumerate(src):
            ray.get(a.set.remote({"w": rr.shard_tensor(full, s_l, r).contiguous()}))
        for r, a in enumerate(dst):
            ray.get(a.set.remote({"w": torch.zeros(d_l.local_shape(r, (512, 256)),
                                                   dtype=torch.bfloat16)}))
        with pytest.raises(ValueError, match="share GPU"):
            rr.ReshardGroup(src, dst, backend="nccl")
        with rr.ReshardGroup(src, dst) as g:
            assert g.backend == "gloo"
            res = g.refit(specs)
            assert res.bytes_by_path["network"] == 0
            g.refit(specs, atomic=True)
        for r, a in enumerate(dst):
            assert torch.equal(ray.get(a.get.remote())["w"],
                               rr.shard_tensor(full.to(torch.bfloat16), d_l, r))
    finally:
        for a in src + dst:
            ray.kill(a)
