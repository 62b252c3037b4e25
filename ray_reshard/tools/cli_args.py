"""Command-line arguments shared by the commands that describe a refit of a real model.

    --model deepseek-v3 | path/to/config.json (or its directory)
    --train megatron:tp=1,pp=16,ep=16,etp=1,dp=16
    --infer vllm:tp=32,dp=8,ep=32
    --gpus-per-node 8

A layout is ``engine:key=value,...`` with the fields of `ray_reshard.models.Megatron` or
`ray_reshard.models.VLLM`, read by their annotations: integers, sequences as ``/``-separated
counts (``layers_per_stage=4/4/3``), booleans as true/false, anything else as text. For
Megatron an omitted ``dp`` is the smallest that fits ``ep * etp`` into each stage, so
``megatron:pp=16,ep=16`` means TP1 x PP16 x EP16 x DP16. Every parse error is an
`argparse.ArgumentTypeError` naming the field and the allowed values; `Parser` prints it as one
line and exits with status 2 (no traceback).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

# Real model configs written inline (no download): name -> (title, HF config).
LLAMA3_70B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "tie_word_embeddings": False,
}
QWEN3_235B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "tie_word_embeddings": False,
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "tie_word_embeddings": False,
    "topk_method": "noaux_tc", "num_nextn_predict_layers": 1,
}
# The demo's small Qwen3-MoE (seconds to plan; what tests and smoke runs use).
SMALL_MOE = {
    "model_type": "qwen3_moe", "hidden_size": 768, "intermediate_size": 2048,
    "moe_intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 12,
    "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 8000, "tie_word_embeddings": False, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "rms_norm_eps": 1e-6, "norm_topk_prob": True,
}
MODELS = {
    "llama70b": ("Llama-3-70B", LLAMA3_70B),
    "qwen3-235b": ("Qwen3-235B-A22B", QWEN3_235B),
    "deepseek-v3": ("DeepSeek-V3", DEEPSEEK_V3),
    "small-moe": ("small Qwen3-MoE", SMALL_MOE),
}
# --dtype spellings -> the inference dtype; "fp8" is block FP8 as vLLM serves it (linear
# projections and routed experts in float8_e4m3fn with 128 x 128 scales, the rest bfloat16)
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32", "fp8": "fp8"}


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# ---------------------------------------------------------------- argument types
def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def number_in(text: str, ok, what: str) -> float:
    """`text` as a float for which `ok(value)` holds (NaN never does), else an argparse error
    that says `what` was expected."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if math.isnan(v) or not ok(v):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return v


def positive_float(text: str) -> float:
    return number_in(text, lambda v: 0 < v < math.inf, "a positive number")


def fraction_arg(text: str) -> float:
    """A number in [0, 1] (e.g. the share of weights changed since the previous refit)."""
    return number_in(text, lambda v: 0.0 <= v <= 1.0, "a fraction in [0, 1]")


def model_arg(text: str) -> tuple[str, dict]:
    """A known model name or a path to a HF config.json (or its directory) -> (title, config)."""
    from ..models import model_dims

    if text in MODELS:
        return MODELS[text]
    path = os.path.join(text, "config.json") if os.path.isdir(text) else text
    if not os.path.isfile(path):
        if os.sep in text or text.endswith(".json") or os.path.isdir(text):
            raise argparse.ArgumentTypeError(f"no such file: {path}")
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a known model ({', '.join(MODELS)}) nor a config.json file")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"{path} does not hold a JSON object")
    try:
        model_dims(config)
    except (ValueError, KeyError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"{path}: {e}") from None
    return os.path.basename(os.path.dirname(os.path.abspath(path))) or path, config


def models_list_arg(text: str) -> list[str]:
    """Comma-separated known model names."""
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in MODELS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown model {', '.join(map(repr, bad)) or repr(text)}; choose from "
            f"{', '.join(MODELS)} (comma-separated)")
    return names


def _int_field(engine: str, key: str, value: str) -> int:
    try:
        v = int(value)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{engine}: {key} must be a positive integer, "
                                         f"got {value!r}")
    return v


_BOOLS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


def dtype_arg(text: str) -> str:
    """A --dtype spelling (bf16 / bfloat16, fp16 / float16, fp32 / float32, fp8) -> its name."""
    name = DTYPES.get(text.lower())
    if name is None:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(DTYPES)}, got {text!r}")
    return name


def layout_arg(text: str, role: Optional[str] = None):
    """``engine:key=value,...`` -> that registered engine's layout (of `role`, when given)."""
    from ..engines import engines

    known = {e.name: e for e in engines(role)}
    name, _, body = text.partition(":")
    name = name.strip().lower()
    if name not in known:
        raise argparse.ArgumentTypeError(
            f"layout {text!r} must start with {' or '.join(n + ':' for n in known)} followed "
            f"by key=value pairs, e.g. {' or '.join(e.example for e in known.values())}")
    eng = known[name]
    fields = {f.name: str(f.type) for f in dataclasses.fields(eng.layout)}
    kw: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in body.split(","))):
        key, eq, value = part.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not eq or key not in fields:
            raise argparse.ArgumentTypeError(
                f"{name}: unknown field {key!r}; allowed: {', '.join(sorted(fields))}")
        kind = fields[key]                 # the annotation, as text
        if "Sequence" in kind:
            kw[key] = tuple(_int_field(name, key, v) for v in value.split("/"))
        elif "bool" in kind:
            if value.lower() not in _BOOLS:
                raise argparse.ArgumentTypeError(f"{name}: {key} must be one of "
                                                 f"{', '.join(_BOOLS)}, got {value!r}")
            kw[key] = _BOOLS[value.lower()]
        elif "int" in kind:
            kw[key] = _int_field(name, key, value)
        else:
            kw[key] = value
    if eng.complete is not None:
        kw = eng.complete(kw)
    try:
        return eng.layout(**kw)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"{name}: {e}") from None


def train_arg(text: str):
    return layout_arg(text, "train")


@dataclass(frozen=True)
class EngineGroups:
    """Several inference groups fed in one refit (`--infer vllm:tp=4,dp=4+vllm:tp=2,dp=8`):
    their ranks follow one another, group by group."""

    groups: tuple

    @property
    def world(self) -> int:
        return sum(g.world for g in self.groups)

    def __str__(self) -> str:
        return " + ".join(map(str, self.groups))


def infer_arg(text: str):
    """One inference layout, or several joined by `+` (destination groups in one refit)."""
    parts = [p for p in text.split("+")]
    if len(parts) == 1:
        return layout_arg(text, "infer")
    return EngineGroups(tuple(layout_arg(p, "infer") for p in parts))


def quantized(infer, dtype_name: str):
    """`infer` as it serves `dtype_name` (fp8: block FP8 on every group), and the dtype of the
    tensors it keeps unquantised."""
    import torch

    if dtype_name != "fp8":
        return infer, getattr(torch, dtype_name)
    if isinstance(infer, EngineGroups):
        return EngineGroups(tuple(quantized(g, "fp8")[0] for g in infer.groups)), torch.bfloat16
    if "quantization" not in {f.name for f in dataclasses.fields(infer)}:
        raise ValueError(f"--dtype fp8: {infer} has no block-FP8 form")
    return dataclasses.replace(infer, quantization="fp8"), torch.bfloat16


def recipe_specs(config: dict, train, infer, dtype, hf_experts: str = "auto") -> dict:
    """The recipe's specs; for `EngineGroups`, each group's joined with
    `combine_destinations` (group ranks in order)."""
    from ..models import Recipe

    if isinstance(infer, EngineGroups):
        from ..layout.destinations import combine_destinations

        return combine_destinations(
            [Recipe(config, train, g, hf_experts=hf_experts).specs(dtype) for g in infer.groups],
            sizes=[g.world for g in infer.groups])
    return Recipe(config, train, infer, hf_experts=hf_experts).specs(dtype)


# ---------------------------------------------------------------- the shared set
def add_refit_args(p: argparse.ArgumentParser) -> None:
    """--model, --train, --infer (all three required), --gpus-per-node, --dtype, --hf-experts."""
    p.add_argument("--model", type=model_arg, required=True,
                   help=f"a known model ({', '.join(MODELS)}) or a path to a HF config.json "
                        f"(or its directory)")
    p.add_argument("--train", type=train_arg, required=True,
                   help="training layout, megatron:tp=..,pp=..,ep=..,etp=..,dp=.. (e.g. "
                        "megatron:pp=16,ep=16) or fsdp:shard=..,replicate=..")
    p.add_argument("--infer", type=infer_arg, required=True,
                   help="inference layout, vllm:tp=..,dp=..,pp=..,ep=.., e.g. vllm:tp=32,dp=8, "
                        "or several groups fed in one refit joined by +")
    p.add_argument("--gpus-per-domain", "--gpus-per-node", dest="gpus_per_domain",
                   type=positive_int, default=8,
                   help="ranks per NVLink domain on each side (default 8)")
    p.add_argument("--dtype", type=dtype_arg, default="bfloat16",
                   help="inference dtype: bf16, fp16, fp32 or fp8 (block FP8, 128 x 128 "
                        "scales; default bf16)")
    add_hf_experts_arg(p)


def add_hf_experts_arg(p: argparse.ArgumentParser) -> None:
    """--hf-experts: how a trainer on HF names (FSDP) names its experts (default split)."""
    p.add_argument("--hf-experts", choices=("split", "fused"), default="split",
                   help="HF naming of experts: split (checkpoints) or fused (transformers >= 5)")


def with_hf_experts(train, hf_experts: str):
    """`train` naming its experts as `hf_experts` says where it leaves that to the installed
    transformers ("auto"): a plan or prediction never depends on the library's version."""
    if getattr(train, "hf_experts", None) == "auto":
        return dataclasses.replace(train, hf_experts=hf_experts)
    return train


@dataclass
class Refit:
    """A described refit: the model, both layouts, the specs and the domains of every rank."""

    title: str
    config: dict
    train: Any
    infer: Any
    gpus_per_domain: int
    specs: dict
    src_domains: list
    dst_domains: list

    def plan(self):
        from ..planning.plan import plan
        from .._gc import gc_paused

        with gc_paused():
            return plan(self.specs, self.src_domains, self.dst_domains)


def domains(side: str, world: int, per_node: int) -> list:
    """Domain label of each rank: consecutive blocks of `per_node` ranks (`train0`, `train1`...)."""
    return [f"{side}{r // per_node}" for r in range(world)]


def build_refit(args: argparse.Namespace, parser: Optional[argparse.ArgumentParser] = None
                ) -> Refit:
    """Specs and domains from parsed `add_refit_args` arguments. A model/layout mismatch (e.g.
    ep not dividing the experts) goes to `parser.error` (one line, status 2) when given."""
    title, config = args.model
    train = even_out_stages(args.train, config.get("num_hidden_layers", 0))
    train = with_hf_experts(train, args.hf_experts)
    try:
        infer, dtype = quantized(args.infer, args.dtype)
        specs = recipe_specs(config, train, infer, dtype, args.hf_experts)
    except ValueError as e:
        if parser is None:
            raise
        text = str(e).splitlines()[0]
        which = ("--train" if text.startswith("Megatron") else
                 "--infer" if text.startswith("vLLM") else "--model/--train/--infer")
        parser.error(f"argument {which}: {text} (model {title})")
    n = args.gpus_per_domain
    return Refit(title, config, train, infer, n, specs,
                 domains("train", train.world, n), domains("infer", infer.world, n))


def even_out_stages(train, layers: int):
    """Megatron with layers that do not divide over the pipeline stages and no first/last stage
    sizes given: the usual split, full middle stages (ceil(layers / pp) each) and the rest shared
    by the first and last stage (DeepSeek-V3 on PP16: 3 + 14 x 4 + 2; Qwen3-235B on PP8:
    11 + 6 x 12 + 11)."""
    from ..models import Megatron

    pp = getattr(train, "pp", 1)
    if (not isinstance(train, Megatron) or pp < 3 or not layers or layers % pp == 0
            or train.first_stage_layers is not None or train.last_stage_layers is not None):
        return train
    middle = -(-layers // pp)
    rest = layers - (pp - 2) * middle
    if rest < 2:
        return train
    return dataclasses.replace(train, first_stage_layers=(rest + 1) // 2,
                               last_stage_layers=rest // 2)


def describe(layout) -> str:
    """`Megatron TP4xPP8` -> `TP4xPP8` (groups: `TP4xDP4 + TP2xDP8`)."""
    if isinstance(layout, EngineGroups):
        return " + ".join(describe(g) for g in layout.groups)
    return str(layout).split(" ", 1)[-1]


def progress(iterable, total: Optional[int] = None, desc: str = "", enable: Optional[bool] = None):
    """A progress bar on stderr for long loops (tqdm; shown only on a terminal by default)."""
    if enable is None:
        enable = sys.stderr.isatty()
    if not enable:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return _bar(iterable, total, desc)
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, leave=False, mininterval=0.5)


def _bar(iterable, total, desc):
    import time

    total = total if total is not None else len(iterable)
    last = 0.0
    for i, x in enumerate(iterable, 1):
        now = time.monotonic()
        if now - last > 0.5 or i == total:
            done = int(30 * i / max(total, 1))
            sys.stderr.write(f"\r{desc} [{'#' * done}{'.' * (30 - done)}] {i}/{total}")
            sys.stderr.flush()
            last = now
        yield x
    sys.stderr.write("\r" + " " * (len(desc) + 50) + "\r")


# ---------------------------------------------------------------- user errors, quiet output
def require_module(module: str, extra: str, what: str) -> None:
    """Raise `argparse.ArgumentTypeError` naming the extra to install when `module` is
    missing (e.g. matplotlib -> `pip install 'ray-reshard[viz]'`)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise argparse.ArgumentTypeError(
            f"{what} needs {module}, which is not installed: pip install 'ray-reshard[{extra}]'")


def output_dir(path: str) -> str:
    """`path` as a directory to write into, created if missing; a one-line
    `argparse.ArgumentTypeError` when it is a file or cannot be created."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(
            f"{path!r} is a file; give a directory (created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"cannot create directory {path!r}: {e.strerror or e}") from None
    if not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"directory {path!r} is not writable")
    return path


def output_file(path: str) -> str:
    """`path` as a file to write at the end of a run, checked at the start: a one-line
    `argparse.ArgumentTypeError` when it is a directory or its directory does not exist."""
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is a directory; give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"directory {parent!r} of {path!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"directory {parent!r} is not writable")
    return path


def say(text: str) -> None:
    """A progress line on stderr (stdout stays the command's result)."""
    print(text, file=sys.stderr, flush=True)


class _RayletFilter:
    """A stdout stand-in that sends the paragraphs Ray's driver prints for the raylet
    ("(raylet) A worker died ...") to the `ray_reshard` logger at DEBUG, and passes the rest."""

    MARK = "(raylet)"

    def __init__(self, stream):
        self._stream = stream
        self._dropped_line = False

    def write(self, text: str) -> int:
        if self.MARK in text:
            import logging

            logging.getLogger("ray_reshard").debug("ray: %s", text.strip())
            self._dropped_line = True
            return len(text)
        if self._dropped_line and text == "\n":      # print()'s end of the dropped message
            self._dropped_line = False
            return len(text)
        self._dropped_line = False
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def raylet_messages_at_debug():
    """Inside the block, messages Ray's driver relays from the raylet (a worker that died, too
    many workers started) are logged at DEBUG on the `ray_reshard` logger instead of printed:
    a command whose result line already names what happened stays quiet."""
    before = sys.stdout
    sys.stdout = _RayletFilter(before)
    try:
        yield
    finally:
        sys.stdout = before
