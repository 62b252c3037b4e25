"""Block FP8 equal to vLLM's own quantiser, bit for bit: an engine refit by ray-reshard serves
the bytes it would hold had it quantised the same weights itself.

vLLM 0.33 (`per_block_cast_to_fp8`, vllm/utils/deep_gemm.py) pads the tensor with zeros to
whole blocks in its own dtype, takes each block's amax in float32, clamps it at 1e-4, divides
by 448 (`sf`), and casts `x * (1.0 / sf)` to float8_e4m3fn. `vllm_block_fp8` below is that
formula, written out here independently of the library.
"""
import pytest
import torch

import ray_reshard as rr
from ray_reshard.execution.reference import simulate_refit
from ray_reshard.execution.fp8 import quantize, reference_quantize
from ray_reshard.layout.quant import BlockFP8

FP8 = torch.float8_e4m3fn


def vllm_block_fp8(x: torch.Tensor, block=(128, 128)):
    """vLLM's per_block_cast_to_fp8 on a 2-d tensor: (FP8 tensor, float32 scales)."""
    m, n = x.shape
    bm, bn = block
    padded = torch.zeros((-(-m // bm) * bm, -(-n // bn) * bn), dtype=x.dtype, device=x.device)
    padded[:m, :n] = x
    view = padded.view(-1, bm, padded.size(1) // bn, bn)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = amax / 448.0
    q = (view * (1.0 / sf)).to(FP8)
    return q.view_as(padded)[:m, :n].contiguous(), sf.view(view.size(0), view.size(2))


def vllm_stacked(x: torch.Tensor, block):
    """Experts stacked on dim 0, each quantised alone (as vLLM's MoE weights are)."""
    parts = [vllm_block_fp8(e, block) for e in x]
    return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])


def data(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1])
    x[..., :3, :5] = 0.0                      # an all-zero corner: amax clamps to 1e-4
    return x.to(dtype)


def bits(t):
    return t.contiguous().view(torch.uint8)


def differing(a, b) -> int:
    return int((bits(a) != bits(b)).sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_and_its_reference_equal_vllm_bit_for_bit(dtype):
    x = data((1024, 1536), dtype)
    want_q, want_s = vllm_block_fp8(x)
    for q, s in (quantize(x, (128, 128)), reference_quantize(x, (128, 128))):
        assert differing(q, want_q) == 0
        assert torch.equal(s, want_s)


def test_the_data_tells_multiplying_by_the_reciprocal_from_dividing():
    """On this data a quantiser that divides (x / sf) differs from vLLM's: the equality above
    would catch one that does."""
    x = data((1024, 1536))
    want_q, _ = vllm_block_fp8(x)
    m, n = x.shape
    view = x.float().view(m // 128, 128, n // 128, 128)
    sf = view.abs().amax(dim=(1, 3), keepdim=True).clamp(1e-4) / 448.0
    divided = (view / sf).to(FP8).view(m, n)
    assert differing(divided, want_q) > 0


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((129, 257), (128, 128)),
                                         ((77, 45), (16, 8)), ((5, 3), (128, 128))])
def test_edge_blocks_equal_vllm_zero_padded(shape, block):
    x = data(shape)
    want_q, want_s = vllm_block_fp8(x, block)
    for q, s in (quantize(x, block), reference_quantize(x, block)):
        assert differing(q, want_q) == 0
        assert torch.equal(s, want_s)


def test_stacked_experts_equal_vllm_per_expert():
    x = data((4, 96, 200))
    want_q, want_s = vllm_stacked(x, (32, 64))
    q, s = quantize(x, (1, 32, 64))
    assert differing(q, want_q) == 0 and torch.equal(s, want_s)


@pytest.mark.parametrize("src_pl", ["aligned", "cut"])
def test_refit_writes_vllms_bytes(src_pl):
    """A refit (reference executor) from bf16 sources into FP8 destinations holds vLLM's bytes
    and scales: sources holding whole blocks quantise on the sender; sources that cut blocks
    (rows 0-99 / 100-199 of 64-row blocks) leave quantising to the destination."""
    full = data((200, 256))
    block = (64, 64)
    q = BlockFP8(block)
    src = rr.Layout(rr.Mesh([0, 1]), (rr.Shard(0, block=128 if src_pl == "aligned" else 100),))
    dst = rr.Layout(rr.Mesh([0, 1]), (rr.Shard(1),))
    spec = rr.TensorSpec(full.shape, FP8, src, dst, src_dtype=full.dtype, quant=q)
    plan = rr.plan({"w": spec})
    srcs = [{"w": rr.shard_tensor(full, src, r)} for r in range(2)]
    dsts = [{"w": torch.zeros(dst.local_shape(r, full.shape), dtype=FP8),
             "w_scale_inv": torch.full(q.scale_shape(dst.local_shape(r, full.shape)), -1.0)}
            for r in range(2)]
    simulate_refit(plan, srcs, dsts, bucket_bytes=8192)
    want_q, want_s = vllm_block_fp8(full, block)
    for r in range(2):
        box = dst.box(r, full.shape)
        assert differing(dsts[r]["w"], want_q[box.slices()]) == 0, r
        assert torch.equal(dsts[r]["w_scale_inv"], want_s[:, r * 2:(r + 1) * 2]), r


@pytest.mark.gpu
def test_quantize_on_cuda_equals_vllm_on_cuda():
    x = data((1024, 1536)).cuda()
    want_q, want_s = vllm_block_fp8(x)
    q, s = quantize(x, (128, 128))
    assert differing(q.cpu(), want_q.cpu()) == 0 and torch.equal(s, want_s)
    cq, cs = quantize(x.cpu(), (128, 128))
    assert differing(cq, want_q.cpu()) == 0 and torch.equal(cs, want_s.cpu())
