"""The ray_reshard backend against vLLM's weight-transfer API on a Ray cluster, for what the CPU
build cannot run (GPU-only MoE backends, MLA): the installed vLLM (0.32's CPU build here;
test_vllm033.py runs this file again against vLLM 0.33's modules).

Real: vLLM's weight_transfer base classes, factories, WeightTransferConfig, TrainerInitInfo and
its Ray weight-sync client; our engines built through those factories; ReshardGroup, trainer
actors and WorkerView actors. Stand-ins: the engine actor (an object with vLLM's four weight-sync
methods and ``collective_rpc``, running two workers in its process, as an engine with the
multiprocessing executor reaches them), and the worker model: an nn.Module with the parameter
names and shapes of the recipe, allocated under torch.inference_mode() as vLLM allocates, whose
load_weights records what it is given; an MLA module derives W_UK_T from kv_b_proj in
process_weights_after_loading; one MoE layer reports the FlashInfer CUTLASS backend (which
rearranges experts), so its experts take the fallback.
"""
import os
import sys
import types

import pytest
import ray
import ray.cloudpickle
import torch

from live import require_vllm

require_vllm()

from ray_reshard.models import (VLLM, Megatron, empty_storage, hf_parameter_shapes,  # noqa: E402
                                local_state, padding_mask)

CONFIG = {"model_type": "deepseek_v3", "vocab_size": 300, "hidden_size": 32,
          "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
          "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 12,
          "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8,
          "topk_method": "noaux_tc"}
TRAIN = Megatron(tp=2, ep=2, etp=1)
INFER = VLLM(tp=2, ep=2)
FALLBACK_LAYER = 1          # its experts report a backend that rearranges them
SENTINEL = 7.0
# the client and helpers below travel to the actors by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def build_model(rank: int):
    """Parameters named and shaped as vLLM keeps them on `rank`, as inference tensors."""
    root = torch.nn.Module()
    store = empty_storage(CONFIG, INFER, rank, dtype=torch.bfloat16, fill=SENTINEL)

    def module(path):
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        return m

    with torch.inference_mode():
        for name, t in store.items():
            *path, leaf = name.split(".")
            module(path).register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
    for l in (1, 2):
        experts = module(f"model.layers.{l}.mlp.experts.routed_experts".split("."))
        name = "FLASHINFER_CUTLASS" if l == FALLBACK_LAYER else "TRITON"
        experts.quant_method = type("UnquantizedFusedMoEMethod", (), {})()
        experts.quant_method.unquantized_backend = types.SimpleNamespace(name=name)

    class MLAAttention(torch.nn.Module):
        def __init__(self, kv_b_proj):
            super().__init__()
            self.kv_b_proj = kv_b_proj
            with torch.inference_mode():
                self.W_UK_T = torch.nn.Parameter(torch.zeros_like(kv_b_proj.weight), requires_grad=False)

        def process_weights_after_loading(self, act_dtype):
            self.W_UK_T.data.copy_(self.kv_b_proj.weight.to(act_dtype) * 2)

    try:        # what vLLM's is_deferred_attention_layer recognises (an ABC: registered)
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        AttentionLayerBase.register(MLAAttention)
    except ImportError:
        pass
    for l in range(3):
        attn = module(f"model.layers.{l}.self_attn".split("."))
        attn.add_module("mla_attn", MLAAttention(attn.kv_b_proj))

    root.loaded = {}

    def load_weights(weights):
        for n, t in weights:
            root.loaded[n] = t.clone()
        return set(root.loaded)
    root.load_weights = load_weights
    return root


class Worker:
    """A vLLM worker's part in the protocol: the engine built by vLLM's factory."""

    def __init__(self, rank):
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory

        from ray_reshard.engines.vllm.backend import RayReshardWeightTransferEngine, register
        register()
        self.rank = rank
        self.model = build_model(rank)
        vllm_config = types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(tensor_parallel_size=INFER.tp),
            model_config=types.SimpleNamespace(dtype=torch.bfloat16, quantization=None,
                                               hf_config=CONFIG))
        self.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="ray_reshard"), vllm_config, torch.device("cpu"),
            self.model)
        assert type(self.weight_transfer_engine) is RayReshardWeightTransferEngine
        self.reloads = []       # vLLM's layerwise reload needs a model it built: recorded,
        self.weight_transfer_engine.begin_reload = lambda: self.reloads.append("begin")
        self.weight_transfer_engine.end_reload = self.end_reload

    def end_reload(self):
        """... and its end re-processes the deferred attention layers, as vLLM's does."""
        self.reloads.append("end")
        for name, m in self.model.named_modules():
            if name.endswith("mla_attn"):
                m.process_weights_after_loading(torch.bfloat16)


@ray.remote(num_cpus=0)
class Engine:
    """An engine actor as vLLM's `LLM` offers it: the four weight-sync methods (each a
    collective_rpc over the workers) and collective_rpc; both workers live in this process."""

    def __init__(self):
        self.workers = [Worker(r) for r in range(INFER.world)]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(method, str):
            return [getattr(w.weight_transfer_engine, method)(*args, **kwargs)
                    for w in self.workers]
        return [method(w, *args, **kwargs) for w in self.workers]

    def init_weight_transfer_engine(self, request):
        for w in self.workers:
            eng = w.weight_transfer_engine
            eng.init_transfer_engine(eng.parse_init_info(request.init_info))

    def start_weight_update(self):
        self.collective_rpc("start_weight_update")

    def update_weights(self, request):
        self.collective_rpc("update_weights", args=(request.update_info,))

    def finish_weight_update(self):
        self.collective_rpc("finish_weight_update")

    def state(self, r):
        w = self.workers[r]
        params = {n: p.data.clone() for n, p in w.model.named_parameters()}
        inference = all(p.is_inference() for p in w.model.parameters())
        eng = w.weight_transfer_engine
        return params, dict(w.model.loaded), list(eng.rederived), w.reloads, eng.version, \
            inference, os.getpid()


@ray.remote(num_cpus=0, max_concurrency=4)
class Trainer:
    """A trainer rank; like a Ray Train worker it takes calls while its loop waits."""

    def __init__(self, rank, storages):
        self.rank, self.storages, self.engine = rank, storages, None

    def init(self, src_actors, engines):
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

        from ray_reshard.engines.vllm.backend import (RayReshardTrainerEngine,
                                                   RayReshardTrainerInitInfo, register)
        register()
        info = RayReshardTrainerInitInfo(
            rank=self.rank, config=CONFIG, train=TRAIN, infer=INFER, src_actors=src_actors,
            tensors=lambda: self.storages, dtype=torch.bfloat16, train_dtype=torch.float32,
            timeout_s=120)
        client = RayVLLMWeightSyncClient(list(engines))
        self.engine = RayReshardTrainerEngine.trainer_init(info, client=client)
        views = [ray.get(v.where.remote())[1] for v in self.engine.views]
        return getattr(self.engine, "fallback", None), views

    def send(self):
        self.engine.send_weights()
        return None if self.engine.last is None else self.engine.last.version

    def bump(self, seed):
        g = torch.Generator().manual_seed(seed)
        for t in self.storages.values():
            t.copy_(torch.randn(t.shape, generator=g))


def test_vllm_backend_end_to_end(cluster):
    g = torch.Generator().manual_seed(0)
    sd = {n: torch.randn(s, generator=g) for n, s in
          hf_parameter_shapes(CONFIG, hf_experts="split").items()}
    engine = Engine.remote()
    trainers = [Trainer.remote(r, local_state(CONFIG, TRAIN, "src", r, sd, dtype=torch.float32,
                                              hf_experts="split"))
                for r in range(TRAIN.world)]
    fallback, view_pids = ray.get([t.init.remote(trainers, [engine]) for t in trainers])[0]
    # the workers are not Ray actors of their own: one WorkerView each, in its own process
    engine_pid = ray.get(engine.state.remote(0))[-1]
    assert len(view_pids) == INFER.world and engine_pid not in view_pids
    # the experts of the FlashInfer-CUTLASS layer go whole to staging, each worker its own
    # (EP 2: worker r holds experts 2r, 2r+1)
    assert fallback == {r: sorted(f"model.layers.{FALLBACK_LAYER}.mlp.experts.{e}.{p}_proj.weight"
                                  for e in (2 * r, 2 * r + 1) for p in ("gate", "up", "down"))
                        for r in range(2)}
    versions = ray.get([t.send.remote() for t in trainers])
    assert versions[0] == 1 and versions[1] is None

    for r in range(INFER.world):
        params, loaded, rederived, reloads, version, inference, _ = ray.get(engine.state.remote(r))
        assert inference and version == 1 and reloads == ["begin", "end"]
        want = local_state(CONFIG, INFER, "dst", r, sd, dtype=torch.bfloat16, hf_experts="split")
        pad = padding_mask(CONFIG, INFER, r)
        for n, t in want.items():
            if f"layers.{FALLBACK_LAYER}.mlp.experts." in n:
                assert bool((params[n] == SENTINEL).all()), f"{n} written in place"
            else:
                data = ~pad[n]
                assert torch.equal(params[n][data], t[data]), f"worker {r}: {n}"
                assert bool((params[n][pad[n]] == SENTINEL).all()), f"worker {r}: padding of {n}"
        # fallback: whole HF tensors, bit-exact, handed to load_weights
        assert set(loaded) == set(fallback[r])
        for n, t in loaded.items():
            assert torch.equal(t, sd[n].to(torch.bfloat16)), n
        # derived tensors recomputed from the new kv_b_proj (by the reload's end: the engine
        # re-derives them itself only after refits with no reload)
        assert rederived == []
        for l in range(3):
            kvb = params[f"model.layers.{l}.self_attn.kv_b_proj.weight"]
            assert torch.equal(params[f"model.layers.{l}.self_attn.mla_attn.W_UK_T"], kvb * 2)

    # a second round with new trainer weights
    ray.get([t.bump.remote(5 + i) for i, t in enumerate(trainers)])
    assert ray.get([t.send.remote() for t in trainers])[0] == 2
    params, *_ = ray.get(engine.state.remote(0))
    assert not torch.equal(params["model.layers.0.self_attn.kv_b_proj.weight"],
                           local_state(CONFIG, INFER, "dst", 0, sd, dtype=torch.bfloat16,
                                       hf_experts="split")["model.layers.0.self_attn.kv_b_proj.weight"])


def test_plan_specs_refuses_mismatched_workers():
    from ray_reshard.engines.vllm.backend import plan_specs
    from ray_reshard.models import storage_shapes

    def describe(r, drop=None, reshape=None, released=None):
        out = {n: {"shape": tuple(s), "dtype": "bfloat16", "why": None}
               for n, s in storage_shapes(CONFIG, INFER, r).items()}
        if drop:
            del out[drop]
        if reshape:
            out[reshape] = {"shape": (1,), "dtype": "bfloat16", "why": None}
        if released:
            out[released] = {"shape": (0,), "dtype": "bfloat16", "why": "released after loading"}
        return out

    name = "model.layers.0.self_attn.kv_b_proj.weight"
    with pytest.raises(ValueError, match=f"vLLM worker 1: no parameter '{name}'"):
        plan_specs(CONFIG, TRAIN, INFER, [describe(0), describe(1, drop=name)])
    with pytest.raises(ValueError, match="vLLM worker 0: .* has shape \\(1,\\)"):
        plan_specs(CONFIG, TRAIN, INFER, [describe(0, reshape=name), describe(1)])
    with pytest.raises(ValueError, match="worker 1 runs tensor_parallel_size=1"):
        plan_specs(CONFIG, TRAIN, INFER, [describe(0), describe(1)],
                   parallel=[{"tp": 2, "pp": 1, "dp": 1}, {"tp": 1, "pp": 1, "dp": 1}])
    specs, staging = plan_specs(CONFIG, TRAIN, INFER, [describe(0), describe(1)])
    assert staging == [{}, {}]
    # a parameter the platform released (shape (0,)) is reloaded from its whole HF tensor,
    # whatever its reported shape: the piece goes whole to every rank holding it
    specs, staging = plan_specs(CONFIG, TRAIN, INFER, [describe(0), describe(1, released=name)])
    assert set(staging[0]) == set(staging[1]) == {name}
    assert {r: slot.storage for r, slot in specs[name].dst_slots} == {0: "full:" + name,
                                                                      1: "full:" + name}


def test_inference_tensors_are_written_through_aliases():
    from ray_reshard.engines.vllm.backend import writable

    with torch.inference_mode():
        t = torch.zeros(3, 4)
    a = writable(t)
    assert not a.is_inference() and a.data_ptr() == t.data_ptr()
    a[1].fill_(2.0)
    assert float(t.sum()) == 8.0


def test_block_fp8_workers_take_fp8_weights_and_scales_as_the_checkpoint_holds_them():
    """A worker serving a block-FP8 checkpoint: every piece goes through the fallback as FP8
    quantised by the senders plus its `_scale_inv`, and those staging tensors equal the
    reference quantisation of the HF tensors (run in one process, the runtime's programs)."""
    import ray_reshard as rr
    from ray_reshard.execution.fp8 import reference_quantize
    from ray_reshard.engines.vllm.backend import FULL, plan_specs
    from ray_reshard.models import storage_shapes
    from ray_reshard.execution.reference import simulate_refit

    fp8 = VLLM(tp=2, ep=2, quantization="fp8", weight_block_size=(4, 4))
    served = {"method": "fp8", "block": (4, 4), "serialized": True}
    described = [{n: {"shape": tuple(s), "dtype": "float8_e4m3fn", "why": "quantized model"}
                  for n, s in storage_shapes(CONFIG, fp8, r).items()} for r in range(fp8.world)]
    with pytest.raises(ValueError, match="vLLM worker 0 serves a block-FP8 checkpoint"):
        plan_specs(CONFIG, TRAIN, INFER, described, quantization=[served] * 2)
    with pytest.raises(ValueError, match="weight_block_size=\\(8, 8\\)"):
        plan_specs(CONFIG, TRAIN, fp8, described, quantization=[dict(served, block=(8, 8))] * 2)
    with pytest.raises(ValueError, match="asks for a block-FP8 checkpoint"):
        plan_specs(CONFIG, TRAIN, fp8, described,
                   quantization=[dict(served, serialized=False)] * 2)
    with pytest.raises(ValueError, match="'awq' checkpoint"):
        plan_specs(CONFIG, TRAIN, INFER, described,
                   quantization=[{"method": "awq", "block": None, "serialized": True}] * 2)

    specs, staging = plan_specs(CONFIG, TRAIN, fp8, described, torch.bfloat16, torch.float32,
                                quantization=[served] * 2)
    shapes = hf_parameter_shapes(CONFIG, hf_experts="split", mtp=True)
    quantised = {n for n, s in specs.items() if s.quant is not None}
    assert quantised and all(specs[n].slot("dst", 0, n).storage.startswith(FULL)
                             for n in quantised if specs[n].dst.box(0, specs[n].shape))
    g = torch.Generator().manual_seed(11)
    sd = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    src = [local_state(CONFIG, TRAIN, "src", r, sd, dtype=torch.float32, hf_experts="split")
           for r in range(TRAIN.world)]
    dst = []
    for r in range(fp8.world):
        store = {FULL + n: torch.full(s, float("nan"), dtype=getattr(torch, dt))
                 for n, (s, dt) in staging[r].items()}
        store.update({n: torch.zeros(s) for n, s in storage_shapes(CONFIG, fp8, r).items()})
        dst.append(store)
    plan = rr.plan(specs, ["s"] * TRAIN.world, ["d0", "d1"])
    simulate_refit(plan, src, dst)
    checked = 0
    for r in range(fp8.world):
        for n, t in staging[r].items():
            if n.endswith("_scale_inv") or t[1] != "float8_e4m3fn":
                continue
            q, s = reference_quantize(sd[n], (4, 4))
            got = dst[r][FULL + n]
            assert torch.equal(got.view(torch.uint8), q.view(torch.uint8)), (r, n)
            assert torch.equal(dst[r][FULL + n + "_scale_inv"], s), (r, n)
            checked += 1
    assert checked > 10


def test_refits_without_a_reload_re_derive_mla_tensors():
    """All in place (no fallback, so no layerwise reload): finish_weight_update recomputes MLA's
    W_UK_T from the kv_b_proj the refit wrote."""
    from ray_reshard.engines.vllm.backend import writable

    worker = Worker(0)
    eng = worker.weight_transfer_engine
    eng.start_weight_update()
    params = dict(worker.model.named_parameters())
    for l in range(3):
        writable(params[f"model.layers.{l}.self_attn.kv_b_proj.weight"].data).fill_(3.0)
    eng.finish_weight_update()
    assert worker.reloads == []
    assert sorted(eng.rederived) == [f"model.layers.{l}.self_attn.mla_attn" for l in range(3)]
    for l in range(3):
        assert bool((params[f"model.layers.{l}.self_attn.mla_attn.W_UK_T"] == 6.0).all())


def test_trainer_needs_its_local_shards():
    """Without `tensors`, the trainer takes its shards from a WeightSource's iter_local() (vLLM
    0.33); a source without it (0.32's iterates gathered full tensors) is refused, naming what
    to pass, and the trainer engine's constructor fits the installed vLLM's signature."""
    from ray_reshard.engines.vllm.backend import RayReshardTrainerEngine, RayReshardTrainerInitInfo

    class FullOnlySource:           # 0.32's WeightSource channels: metadata(), __iter__
        def metadata(self):
            return []

        def __iter__(self):
            return iter(())

    info = RayReshardTrainerInitInfo(rank=1, config=CONFIG, train=TRAIN, infer=INFER)
    with pytest.raises(ValueError, match="RayReshardTrainerInitInfo.tensors"):
        RayReshardTrainerEngine.trainer_init(info, client=None, source=FullOnlySource())

    class LocalSource(FullOnlySource):
        def iter_local(self):
            return iter([("w", torch.zeros(1))])

    engine = RayReshardTrainerEngine.trainer_init(
        RayReshardTrainerInitInfo(rank=1, config=CONFIG, train=TRAIN, infer=INFER,
                                  src_actors=["a0", "a1"], key="local-source"),
        client=None, source=LocalSource())
    assert not engine.is_sender and engine.rank == 1
    from ray_reshard.engines.views import local_tensors
    assert set(local_tensors("local-source")) == {"w"}


def _method(name, **attrs):
    """An object whose class is named `name` (what the backend reads of a quant method)."""
    return type(name, (), attrs)()


class PackedGemm(torch.nn.Module):
    """A module whose CPU GEMM computes with a packed copy made by its quant method's post-load
    step (vLLM's CPU build), not with the weight it is handed."""

    def __init__(self, weight, method="UnquantizedEmbeddingMethod"):
        super().__init__()
        self.weight = weight
        self.packs = 0

        def process(layer):
            layer.packed = layer.weight.detach().clone()
            layer.packs += 1
        self.quant_method = _method(method, process_weights_after_loading=staticmethod(process))
        self.quant_method.process_weights_after_loading(self)

    def cpu_linear(self, x, weight, bias):
        return torch.nn.functional.linear(x, self.packed, bias)


def fake_model(tied=True, embedding_method="UnquantizedEmbeddingMethod"):
    """An LM head (packed GEMM), an embedding (looked up from its parameter), tied or not; a
    linear layer whose weight the platform released; a layer with a released weight and a
    bias; MoE experts whose backend rearranges them; a norm."""
    p = lambda *s: torch.nn.Parameter(torch.randn(*s), requires_grad=False)   # noqa: E731
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    emb = torch.nn.Module()
    emb.weight = p(16, 4)
    emb.quant_method = _method(embedding_method)
    root.model.embed_tokens = emb
    root.lm_head = PackedGemm(emb.weight if tied else p(16, 4))
    root.model.proj = torch.nn.Module()
    root.model.proj.weight = p(0)
    root.model.biased = torch.nn.Module()
    root.model.biased.weight = p(0)
    root.model.biased.bias = p(4)
    experts = torch.nn.Module()
    experts.w13_weight, experts.w2_weight = p(2, 8, 4), p(2, 4, 4)
    experts.quant_method = _method("UnquantizedFusedMoEMethod",
                                   unquantized_backend=types.SimpleNamespace(name="FLASHINFER"))
    root.model.experts = experts
    root.model.norm = torch.nn.Module()
    root.model.norm.weight = p(4)
    return root


def test_route_decides_per_parameter_from_what_the_forward_pass_reads():
    """The backend's decisions on stand-in modules: norms and an embedding lookup in place; a
    released weight, its module's other parameters, rearranged experts and an untied LM head
    reading a packed copy through load_weights; a tied LM head in place with its embedding, its
    packed copy rebuilt from the new bytes after the update."""
    from ray_reshard.engines.vllm.routes import PACKED_COPY, describe_model

    out, exposed, fallback, repack = describe_model(fake_model(tied=False), quantized=False)
    why = {n: d["why"] for n, d in out.items()}
    assert why["model.norm.weight"] is None and why["model.embed_tokens.weight"] is None
    assert why["lm_head.weight"] == PACKED_COPY
    assert "released after loading" in why["model.proj.weight"]
    assert why["model.biased.bias"].startswith("its module is reloaded as a whole (weight: ")
    assert "rearranges expert weights" in why["model.experts.w13_weight"]
    assert "rearranges expert weights" in why["model.experts.w2_weight"]
    assert set(exposed) == {"model.norm.weight", "model.embed_tokens.weight"}
    assert repack == [] and {"lm_head", "model.proj", "model.biased", "model.experts"} <= fallback

    model = fake_model(tied=True)
    out, exposed, fallback, repack = describe_model(model, quantized=False)
    assert out["lm_head.weight"]["why"] is None
    assert out["lm_head.weight"]["tied"] == "model.embed_tokens.weight"
    assert repack == ["lm_head"] and "lm_head" not in fallback
    # the tied head of a quantized model, or one whose embedding must be reloaded, goes with it
    out, *_ = describe_model(fake_model(tied=True), quantized=True)
    assert all(d["why"] is not None for d in out.values())
    out, exposed, _, repack = describe_model(fake_model(tied=True, embedding_method="Quirky"),
                                             quantized=False)
    assert out["model.embed_tokens.weight"]["why"] == "Quirky processes weights after loading"
    assert out["lm_head.weight"]["why"] == PACKED_COPY       # reloaded on its own account
    assert repack == [] and "model.embed_tokens.weight" not in exposed
    # an alias read in place whose tensor another alias must reload follows it
    model = fake_model(tied=True)
    model.model.embed_tokens.quant_method = _method("UnquantizedEmbeddingMethod")
    model.lm_head.quant_method = _method("Quirky")
    out, *_ = describe_model(model, quantized=False)
    assert out["model.embed_tokens.weight"]["why"] == ("tied to lm_head.weight, which goes "
                                                       "through load_weights")


def test_a_tied_heads_packed_copy_follows_the_embedding_written_in_place():
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from ray_reshard.engines.vllm.backend import RayReshardInitInfo, register, writable
    register()
    model = fake_model(tied=True)
    vllm_config = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1),
        model_config=types.SimpleNamespace(dtype=torch.float32, quantization=None))
    eng = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="ray_reshard"), vllm_config, torch.device("cpu"), model)
    eng.init_transfer_engine(RayReshardInitInfo(key="tied"))
    eng.describe("tied")
    new = torch.randn(16, 4)
    x = torch.randn(3, 4)
    eng.start_weight_update()
    writable(eng.tensors("tied")["model.embed_tokens.weight"]).copy_(new)
    eng.update_weights({"version": 1, "key": "tied"})
    assert not torch.equal(model.lm_head.cpu_linear(x, None, None), x @ new.T)  # stale copy
    eng.finish_weight_update()
    assert eng.repacked == ["lm_head"]
    assert torch.equal(model.lm_head.cpu_linear(x, None, None), x @ new.T)
    eng.forget("tied")
