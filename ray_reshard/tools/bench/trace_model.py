"""The weights a delta benchmark refits: a GPT-like model trained RL-like in mixed precision
(`Trainer`), or random weights changed at a given fraction (`Synthetic`); and the digests that
check every destination holds them bit for bit."""
from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass

import torch
from torch import nn

from .harness import MiB


@dataclass(frozen=True)
class ModelConfig:
    """A GPT-like model's sizes, and the batch it trains on."""

    vocab: int
    d_model: int
    heads: int
    ffn: int
    layers: int
    seq: int = 64
    batch: int = 4

    @property
    def params(self) -> int:
        d, f = self.d_model, self.ffn
        per_layer = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
        return 2 * self.vocab * d + self.seq * d + self.layers * per_layer + 2 * d


def config_for(mb: int) -> ModelConfig:
    """A model of about `mb` MiB of bf16 weights (at least one layer)."""
    d = 256 if mb <= 16 else 512 if mb <= 64 else 1024
    vocab = 2048 if d <= 256 else 8192
    probe = ModelConfig(vocab, d, d // 64, 4 * d, 0)
    per_layer = ModelConfig(vocab, d, d // 64, 4 * d, 1).params - probe.params
    layers = max(1, round((mb * MiB / 2 - probe.params) / per_layer))
    return ModelConfig(vocab, d, d // 64, 4 * d, layers)


class TinyGPT(nn.Module):
    """Token and position embeddings, pre-norm transformer layers (causal), norm, head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.seq, cfg.d_model))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(cfg.d_model, cfg.heads, cfg.ffn, dropout=0.0,
                                       batch_first=True, norm_first=True)
            for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for p in (self.tok.weight, self.pos, self.head.weight):
            nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.tok(tokens) + self.pos[:n]
        mask = nn.Transformer.generate_square_subsequent_mask(n, dtype=x.dtype)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


class Trainer:
    """Mixed precision: forward and backward on bf16 weights, Adam on an fp32 master copy,
    the bf16 weights rounded from it after every step."""

    def __init__(self, cfg: ModelConfig, lr: float, seed: int = 0):
        torch.manual_seed(seed)
        self.cfg = cfg
        self.master = TinyGPT(cfg)
        self.model = copy.deepcopy(self.master).to(torch.bfloat16)
        self.opt = torch.optim.Adam(self.master.parameters(), lr=lr)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def weights(self) -> dict:
        """The bf16 weights (the ones refit), by parameter name."""
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def step(self) -> float:
        """One REINFORCE-like step; returns the loss."""
        cfg = self.cfg
        actions = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=self.gen)
        advantage = torch.randn(cfg.batch, 1, generator=self.gen)
        advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-6)
        logits = self.model(actions[:, :-1])
        logp = torch.log_softmax(logits.float(), -1).gather(-1, actions[:, 1:, None])[..., 0]
        loss = -(advantage * logp).mean()
        self.model.zero_grad(set_to_none=True)
        loss.backward()
        for master, low in zip(self.master.parameters(), self.model.parameters()):
            master.grad = low.grad.float()
        self.opt.step()
        with torch.no_grad():
            for master, low in zip(self.master.parameters(), self.model.parameters()):
                low.copy_(master)
        return float(loss.detach())


class Synthetic:
    """Random bf16 weights of a model's shapes; each step flips the lowest bit of each element
    with probability `fraction`."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        shapes = {n: p.shape for n, p in TinyGPT(cfg).named_parameters()}
        self.w = {n: (torch.randn(s, generator=self.gen) * 0.02).to(torch.bfloat16)
                  for n, s in shapes.items()}
        self.fraction = 0.0

    def weights(self) -> dict:
        return self.w

    def step(self) -> float:
        f = self.fraction
        if f <= 0:
            return 0.0
        for t in self.w.values():
            bits = t.view(-1).view(torch.int16)
            if f >= 1:
                bits ^= 1
            else:
                mask = torch.rand(bits.numel(), generator=self.gen) < f
                bits[mask] ^= 1
        return 0.0


def changed_share(new: dict, old: dict) -> float:
    """Share of the elements whose bits differ between two sets of bf16 weights."""
    changed = total = 0
    for n, t in new.items():
        changed += int(torch.count_nonzero(t.view(torch.int16) != old[n].view(torch.int16)))
        total += t.numel()
    return changed / total if total else 0.0


def digest(tensors: list) -> str:
    """BLAKE2 of the tensors' bytes, in order."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def region(t: torch.Tensor, box) -> torch.Tensor:
    """The part of a full tensor a layout's box covers."""
    for dim, (start, size) in enumerate(zip(box.offsets, box.sizes)):
        t = t.narrow(dim, start, size)
    return t
