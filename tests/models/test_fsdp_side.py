"""The FSDP2 training side: Hugging Face parameters sharded on dim 0 as torch's fully_shard cuts
them (torch.chunk, uneven and empty last shards, HSDP replicas), refit into vLLM's fused,
tensor- and expert-parallel storages.

Expected shards are computed here with torch.chunk over transformers' own named_parameters(),
and once with a real fully_shard in a gloo process group; expected vLLM storages come from
engine_reference, never from the recipes under test."""
from __future__ import annotations

import copy
import functools
import time

import pytest
import torch

import ray_reshard as rr
from ray_reshard.execution.reference import simulate_refit
from ray_reshard.layout import Layout, assemble
from ray_reshard.models import (FSDP, VLLM, Megatron, empty_storage, enumerate_pieces,
                                fsdp_local_tensors, local_state, model_dims, padding_mask,
                                refit_specs, storage_shapes)
from engine_reference import reference_state
from models_testutil import make_model, split_experts

SENTINEL = 7.0
ROUTER_BIAS = "e_score_correction_bias"
MODELS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "qwen3_moe": ("qwen3_moe", {}),
    "deepseek_v3": ("deepseek_v3", {}),
}


@functools.lru_cache(maxsize=None)
def model_of(key: str):
    family, over = MODELS[key]
    cfg, model = make_model(family, **over)
    return cfg, model, model.state_dict()


def fsdp_chunk(full: torch.Tensor, shard: int, index: int) -> torch.Tensor:
    """What FSDP2 keeps on shard `index`: torch.chunk of dim 0, empty past the last chunk."""
    chunks = torch.chunk(full, shard, dim=0)
    return chunks[index] if index < len(chunks) else full[:0]


def fsdp_reference(model, shard: int, replicate: int, rank: int, sd=None) -> dict:
    """Every local tensor of an FSDP2 rank: the model's named_parameters() chunked on dim 0 (the
    HSDP replica index does not matter), the routing-bias buffers whole in float32. `sd`
    (optional) replaces the model's tensors, e.g. by checkpoint-style experts."""
    assert 0 <= rank < shard * replicate
    if sd is None:
        sd = dict(model.named_parameters())
        sd.update((n, b) for n, b in model.named_buffers() if ROUTER_BIAS in n)
    out = {}
    for n, t in sd.items():
        if ROUTER_BIAS in n:
            out[n] = t.detach().float()
        else:
            out[n] = fsdp_chunk(t.detach(), shard, rank % shard)
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# -------------------------------------------------------------------------- the FSDP storages

@pytest.mark.parametrize("key", list(MODELS))
@pytest.mark.parametrize("shard,replicate", [(1, 1), (3, 1), (2, 2), (3, 2), (7, 1)])
def test_local_state_is_what_fsdp2_holds(key, shard, replicate):
    cfg, model, sd = model_of(key)
    par = FSDP(shard, replicate)
    names = [n for n, _ in model.named_parameters()]
    empty = 0
    for r in range(par.world):
        want = fsdp_reference(model, shard, replicate, r)
        got = local_state(cfg, par, "src", r, sd)
        # the HF names exactly (a tied head is the embedding's one parameter)
        assert set(got) == set(want) and set(names) <= set(got)
        assert storage_shapes(cfg, par, r) == {n: tuple(t.shape) for n, t in want.items()}
        for n, t in want.items():
            assert same(got[n], t), (key, par, r, n)
            empty += t.numel() == 0
        # every element is data: FSDP shards carry no padding
        assert not any(m.any() for m in padding_mask(cfg, par, r).values())
    if shard == 7:
        assert empty > 0          # q_norm/k_norm (16 rows) leave the 7th shard empty


@pytest.mark.parametrize("key", ["qwen3_moe", "deepseek_v3"])
def test_checkpoint_style_experts(key):
    cfg, model, sd = model_of(key)
    split = split_experts(sd)
    par = FSDP(3, hf_experts="split")
    for r in range(par.world):
        want = fsdp_reference(model, 3, 1, r, sd={n: t for n, t in split.items()
                                                  if "rotary" not in n})
        got = local_state(cfg, par, "src", r, split, hf_experts="split")
        assert set(got) == set(want)
        for n, t in want.items():
            assert same(got[n], t), (r, n)
    # the recipe must name experts as the trainer does
    with pytest.raises(ValueError, match="hf_experts"):
        refit_specs(cfg, par, VLLM(tp=2), hf_experts="fused")
    with pytest.raises(ValueError, match="hf_experts"):
        local_state(cfg, FSDP(2, hf_experts="fused"), "src", 0, split, hf_experts="split")


def test_parameters_are_checked():
    for kw, what in (({"shard": 0}, "shard"), ({"shard": 2, "replicate": 0}, "replicate"),
                     ({"shard": True}, "shard"), ({"shard": 2.0}, "shard"),
                     ({"shard": 2, "hf_experts": "stacked"}, "hf_experts")):
        with pytest.raises(ValueError, match=what):
            FSDP(**kw)
    cfg, _, sd = model_of("qwen3")
    with pytest.raises(ValueError, match="0..3"):
        local_state(cfg, FSDP(2, 2), "src", 4, sd)
    assert FSDP(3).world == 3 and FSDP(2, 3).world == 6
    assert FSDP(2, 3).coords(5) == (2, 1)
    assert str(FSDP(3)) == "FSDP2 shard3" and str(FSDP(2, 2)) == "FSDP2 HSDP2x2"


# ----------------------------------------------------------------------- a real fully_shard

WORLD = 4


def _real_fsdp2_worker(rank: int, store: str):
    """One process of a gloo group: FSDP2 over 4 ranks and HSDP 2 x 2 on a Qwen3-MoE model
    with dims that do not divide (vocabulary 1001, dense intermediate 90, 5 experts: the 4th
    shard of every expert tensor is empty), checked against local_state, and after an
    optimizer step against the parameters' full_tensor()."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        cfg, model = make_model("qwen3_moe", num_experts=5, vocab_size=1001,
                                intermediate_size=90)
        sd = {n: t.clone() for n, t in model.state_dict().items()}
        for shard, replicate in ((WORLD, 1), (2, 2)):
            m = copy.deepcopy(model).train()
            shape, names = ((WORLD,), ("shard",)) if replicate == 1 else \
                ((replicate, shard), ("replicate", "shard"))
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            for layer in m.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(m, mesh=mesh)
            par = FSDP(shard, replicate)
            specs = refit_specs(cfg, par, VLLM(tp=1), torch.float32)
            params = dict(m.named_parameters())
            # the layouts the recipe gives equal those of FSDP2's own DTensors
            for n, p in params.items():
                assert tuple(p.device_mesh.mesh.flatten().tolist()) == tuple(range(WORLD))
                mine = specs[n + "@gate" if n.endswith("gate_up_proj") else n].src
                theirs = Layout.from_dtensor(p)
                assert mine.box(rank, p.shape) == theirs.box(rank, p.shape), (n, par)
            got = fsdp_local_tensors(m)
            want = local_state(cfg, par, "src", rank, sd)
            assert set(want) <= set(got) and set(got) - set(want) == {
                "model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
            for n, t in want.items():
                assert same(got[n], t), (rank, par, n)
                assert same(got[n], params[n].to_local().detach()), (rank, par, n)
            # 5 experts: chunks of 2, 2, 1 and an empty 4th shard; HSDP: 3 and 2
            experts = got["model.layers.0.mlp.experts.gate_up_proj"].shape[0]
            assert experts == ((2, 2, 1, 0) if shard == WORLD else (3, 2))[rank % shard]
            # a training step changes every shard in place; the helper reads the new values
            opt = torch.optim.SGD(m.parameters(), lr=0.5)
            x = torch.randint(0, 1001, (2, 5), generator=torch.Generator().manual_seed(rank))
            m(x, labels=x).loss.backward()
            opt.step()
            full = {n: p.full_tensor().detach() for n, p in m.named_parameters()}
            assert not torch.equal(full["model.norm.weight"], sd["model.norm.weight"])
            got = fsdp_local_tensors(m)
            for n, t in local_state(cfg, par, "src", rank, full).items():
                assert same(got[n], t), (rank, par, n, "after a step")
    finally:
        dist.destroy_process_group()


def test_real_fully_shard_in_a_gloo_group(tmp_path):
    import torch.multiprocessing as mp

    # fork: the children start with this process's imports (spawn re-imports torch and
    # transformers in each, several times the CPU of the check itself)
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    ctx = mp.start_processes(_real_fsdp2_worker, args=(str(tmp_path / "store"),),
                             nprocs=WORLD, join=False, start_method=method)
    deadline = time.monotonic() + 240
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "the FSDP2 processes did not finish in 240 s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()


# ----------------------------------------------------------------------- refits to vLLM

def refit_and_check(cfg, sd, train, infer, dtype, src, hf_experts="auto"):
    """Plan the refit, run it on `src` (the trainer's storages), check every destination rank
    bit for bit against the engine's loading rules (padding rows keep the fill) and against
    local_state outside padding."""
    specs = refit_specs(cfg, train, infer, dtype=dtype, train_dtype=torch.float32,
                        hf_experts=hf_experts)
    dst = [empty_storage(cfg, infer, r, dtype=dtype, fill=SENTINEL) for r in range(infer.world)]
    plan = rr.plan(specs, [("s", r // 2) for r in range(train.world)],
                   [("d", r // 2) for r in range(infer.world)])
    assert plan.stats.network_bytes >= plan.stats.min_network_bytes
    simulate_refit(plan, src, dst)
    for r in range(infer.world):
        want = reference_state(cfg, sd, infer, r, dtype=dtype, fill=SENTINEL)
        assert set(want) == set(dst[r]), sorted(set(want) ^ set(dst[r]))
        for n, t in want.items():
            assert same(dst[r][n], t), (str(train), str(infer), r, n)
        named = split_experts(sd) if hf_experts == "split" else sd
        ours = local_state(cfg, infer, "dst", r, named, dtype=dtype, hf_experts=hf_experts)
        for n, pad in padding_mask(cfg, infer, r, hf_experts=hf_experts).items():
            assert torch.equal(dst[r][n][~pad], ours[n][~pad]), (r, n)
    return specs


DENSE_INFER = [VLLM(tp=1), VLLM(tp=2)]
MOE_INFER = DENSE_INFER + [VLLM(tp=2, ep=2), VLLM(tp=1, dp=3, ep=3),
                           VLLM(tp=2, dp=2, ep=4, expert_placement="round_robin")]
CASES = [(key, train, infer, dtype)
         for key in MODELS
         for train in (FSDP(3), FSDP(2, 2))
         for infer in (MOE_INFER if key in ("qwen3_moe", "deepseek_v3") else DENSE_INFER)
         for dtype in ((torch.bfloat16, torch.float32) if infer.tp == 2 and infer.ep == 1
                       else (torch.bfloat16,))]


@pytest.mark.parametrize("key,train,infer,dtype", CASES,
                         ids=[f"{k}-{t}-{i}-{str(d)[6:]}".replace(" ", "")
                              for k, t, i, d in CASES])
def test_refit_fsdp_to_vllm(key, train, infer, dtype):
    cfg, model, sd = model_of(key)
    src = [fsdp_reference(model, train.shard, train.replicate, r) for r in range(train.world)]
    specs = refit_and_check(cfg, sd, train, infer, dtype, src)
    # separate q/k/v and gate/up in, vLLM's fused storages out
    if key != "deepseek_v3":
        assert "model.layers.0.self_attn.k_proj.weight" in specs
    if infer.ep > 1 and (model_dims(cfg).experts % infer.ep or
                         infer.expert_placement != "linear"):
        assert any("@e" in n for n in specs)      # per-expert pieces, each in one FSDP chunk


@pytest.mark.parametrize("infer", [VLLM(tp=2, pp=2), VLLM(tp=1, pp=3, dp=2)])
def test_refit_fsdp_to_pipelined_vllm(infer):
    cfg, model, sd = model_of("qwen3-tied")         # the tied head on the last stage too
    train = FSDP(3, 2)
    src = [fsdp_reference(model, 3, 2, r) for r in range(train.world)]
    refit_and_check(cfg, sd, train, infer, torch.bfloat16, src)


@pytest.mark.parametrize("key", ["qwen3_moe", "deepseek_v3"])
def test_refit_checkpoint_style_experts(key):
    cfg, model, sd = model_of(key)
    split = {n: t for n, t in split_experts(sd).items() if "rotary" not in n}
    train = FSDP(3, hf_experts="split")
    src = [fsdp_reference(model, 3, 1, r, sd=split) for r in range(train.world)]
    for infer in (VLLM(tp=2), VLLM(tp=1, dp=3, ep=3)):
        refit_and_check(cfg, sd, train, infer, torch.bfloat16, src, hf_experts="split")


# ---------------------------------------------------- pieces of rows (q/k/v query groups)

def test_group_pieces_are_placed_exactly_or_refused():
    """q/k/v cut per query group (as a Megatron side with several groups per rank asks): each
    group piece is laid out on the ranks whose chunks hold its rows, at the right rows of their
    storage, or refused with an error naming the piece, the parameter and the shard count."""
    placed = refused = 0
    for kv, hd, heads in ((2, 16, 8), (4, 16, 8), (4, 8, 4), (3, 8, 6), (8, 4, 8)):
        cfg = dict(model_type="qwen3", vocab_size=64, hidden_size=24, num_hidden_layers=1,
                   num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
                   intermediate_size=32)
        dims = model_dims(cfg)
        pieces = [pc for pc in enumerate_pieces(dims, split_groups=True, per_expert=False,
                                                hf_experts="fused") if pc.group is not None]
        for shard in range(1, 10):
            side = FSDP(shard, 2).side(dims)
            decls = {r: side.storages(r) for r in range(side.n_ranks)}
            for pc in pieces:
                full_shape = decls[0][pc.hf].shape[1:]
                rows = sum(decls[r][pc.hf].shape[0] for r in range(shard))
                full = torch.arange(rows * full_shape[0]).reshape((rows,) + full_shape)
                try:
                    layout, slots = side.place(pc)
                except ValueError as e:
                    assert pc.name in str(e) and pc.hf in str(e) and f"shard={shard}" in str(e)
                    refused += 1
                    continue
                piece = full[pc.offset:pc.offset + pc.shape[0]]
                shards = {}
                for r, slot in slots:
                    box = layout.box(r, pc.shape)
                    local = fsdp_chunk(full, shard, r % shard)
                    shards[r] = slot.view(local, box.sizes)
                    assert torch.equal(shards[r], piece[box.slices()]), (pc.name, shard, r)
                assert torch.equal(assemble(shards, layout, pc.shape), piece)
                placed += 1
    assert placed > refused > 0


@pytest.mark.parametrize("over,shard,replicate,per_rank_slots", [
    # 2 query groups, q_proj 128 rows: chunks of 64 start each group
    ({}, 2, 1, False),
    # 3 query groups of 32 q rows / 16 k, v rows over 2: group 1 spans both chunks, the longer
    # part in the first (a table of per-rank slots)
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, 2, 2, True),
])
def test_fsdp_and_megatron_both_ways(over, shard, replicate, per_rank_slots):
    """Megatron TP1 keeps all query groups in one linear_qkv, so q/k/v are cut per group."""
    cfg, model = make_model("qwen3", **over)
    sd = model.state_dict()
    fsdp, megatron = FSDP(shard, replicate), Megatron(tp=1, dp=2)
    for train, infer in ((fsdp, megatron), (megatron, fsdp)):
        specs = refit_specs(cfg, train, infer, dtype=torch.bfloat16, train_dtype=torch.float32)
        assert any("@g1" in n for n in specs)
        tables = [sp.src_slots if train is fsdp else sp.dst_slots for sp in specs.values()]
        assert any(t.uniform is None for t in tables) == per_rank_slots
        if train is fsdp:
            src = [fsdp_reference(model, shard, replicate, r) for r in range(train.world)]
        else:
            src = [reference_state(cfg, sd, train, r, dtype=torch.float32)
                   for r in range(train.world)]
        dst = [empty_storage(cfg, infer, r, dtype=torch.bfloat16, fill=SENTINEL)
               for r in range(infer.world)]
        simulate_refit(rr.plan(specs, [0] * train.world, [1] * infer.world), src, dst)
        bf16 = {n: t.to(torch.bfloat16) for n, t in sd.items()}
        for r in range(infer.world):
            if infer is fsdp:
                want = fsdp_reference(model, shard, replicate, r,
                                      sd={n: bf16[n] for n, _ in model.named_parameters()})
            else:
                want = reference_state(cfg, sd, infer, r, dtype=torch.bfloat16, fill=SENTINEL)
            assert set(want) == set(dst[r])
            for n, t in want.items():
                assert same(dst[r][n], t), (str(train), str(infer), r, n)


def test_group_pieces_fsdp_cannot_lay_out_are_refused():
    cfg, _, _ = model_of("qwen3")
    # shard=3 cuts q_proj (128 rows) in chunks of 43: group 1 (rows 64..127) starts inside
    # chunk 1 and goes on over chunk 2, longer than its part in chunk 1: no one layout says so
    with pytest.raises(ValueError, match=r"q_proj\.weight@g1.*shard=3"):
        refit_specs(cfg, FSDP(3), Megatron(tp=1))
