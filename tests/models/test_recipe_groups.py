"""Several destination groups fed in one refit from model recipes: prefill and decode engines
of different layouts (and one serving FP8), planned together with `combine_destinations`."""
import pytest
import torch

import ray_reshard as rr
from ray_reshard.models import Megatron, VLLM, empty_storage, local_state, refit_specs
from ray_reshard.execution.reference import simulate_refit

from models_testutil import make_model

FILL = 7.0


def refit(cfg, specs, train, sd, dst_worlds, src_domains, dst_domains, infers):
    src = [local_state(cfg, train, "src", r, sd, dtype=torch.float32)
           for r in range(train.world)]
    dst = [empty_storage(cfg, infer, r, dtype=torch.bfloat16, fill=FILL)
           for infer in infers for r in range(infer.world)]
    assert len(dst) == sum(dst_worlds)
    plan = rr.plan(specs, src_domains=src_domains, dst_domains=dst_domains)
    simulate_refit(plan, src, dst)
    return plan, dst


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("decode_fp8", [False, True])
def test_prefill_and_decode_groups_in_one_refit_equal_their_own_refits(decode_fp8):
    cfg, model = make_model("qwen3_moe")
    sd = model.state_dict()
    train = Megatron(tp=2, ep=2, etp=1)
    prefill = VLLM(tp=2)
    decode = VLLM(tp=1, dp=2, quantization="fp8" if decode_fp8 else None,
                  weight_block_size=(16, 16))
    groups = {"prefill": refit_specs(cfg, train, prefill, torch.bfloat16, torch.float32),
              "decode": refit_specs(cfg, train, decode, torch.bfloat16, torch.float32)}
    specs = rr.combine_destinations(groups)
    # prefill ranks 0-1 and decode replica 0 (rank 2) share node d0; decode replica 1 on d1
    src_domains = ["s"] * train.world
    dst_domains = ["d0", "d0", "d0", "d1"]
    plan, got = refit(cfg, specs, train, sd, [2, 2], src_domains, dst_domains, [prefill, decode])
    assert plan.stats.network_bytes == plan.stats.min_network_bytes
    apart = 0
    for (label, own), infer, doms, at in ((("prefill", groups["prefill"]), prefill,
                                           dst_domains[:2], 0),
                                          (("decode", groups["decode"]), decode,
                                           dst_domains[2:], 2)):
        p, want = refit(cfg, own, train, sd, [infer.world], src_domains, doms, [infer])
        apart += p.stats.network_bytes
        for r in range(infer.world):
            assert set(got[at + r]) == set(want[r])
            for n, t in want[r].items():
                assert same(got[at + r][n], t), (label, r, n)
    if decode_fp8:
        assert any(n.endswith("#decode") for n in specs)
        assert any(t.dtype == torch.float8_e4m3fn for t in got[2].values())
    # In d0 both groups need the whole model: planned together it crosses into d0 once.
    assert plan.stats.network_bytes < apart
