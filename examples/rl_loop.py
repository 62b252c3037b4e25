"""An RL-style loop: trainers take optimizer steps, engines generate with the refitted weights.

A tiny language model (embedding E, MLP W1/W2 to vocabulary logits) is trained tensor-parallel
over 2 trainer actors on one node (W1 split by rows, W2 by columns, Megatron style; the driver
sums the partial logits, which is the all-reduce), and served by 2 inference engines on another
node, each a full replica (DP2). Every step: one optimizer step on the trainers, a refit, then
the engines generate greedily. Each step checks that generation used the new weights: the
engines' logits equal the trainers' logits for the same tokens after the step (and differ from
the previous step's), and every process reports the new version.

    python examples/rl_loop.py [--steps 5] [--vocab 512] [--hidden 256]
"""
import argparse

import ray
import torch

import ray_reshard as rr
from ray_reshard.testing import connect



TP, DP = 2, 2


def layouts():
    train = rr.Mesh([0, 1], ("tp",))
    infer = rr.Mesh([[0], [1]], ("dp", "tp"))
    rep_infer = rr.Layout(infer, (rr.Replicate(), rr.Replicate()))
    return {
        "E": (rr.Layout(train, (rr.Replicate(),)), rep_infer),     # frozen embedding
        "W1": (rr.Layout(train, (rr.Shard(0),)), rep_infer),       # column-parallel
        "W2": (rr.Layout(train, (rr.Shard(1),)), rep_infer),       # row-parallel
    }


@ray.remote(num_cpus=0)
class Trainer:
    """One tensor-parallel rank: holds its shards and an Adam optimizer over them."""

    def __init__(self, shards: dict, lr: float):
        self.p = {n: t.clone() for n, t in shards.items()}
        for n in ("W1", "W2"):
            self.p[n].requires_grad_(True)
        self.opt = torch.optim.Adam([self.p["W1"], self.p["W2"]], lr=lr)
        self.partial = None

    def reshard_tensors(self):
        return {n: t.detach() for n, t in self.p.items()}

    def forward(self, tokens):
        """This rank's partial logits for `tokens` (summed over ranks = the logits)."""
        x = self.p["E"][tokens]
        self.partial = torch.relu(x @ self.p["W1"].T) @ self.p["W2"].T
        return self.partial.detach()

    def backward_step(self, grad_logits):
        self.opt.zero_grad()
        self.partial.backward(grad_logits)
        self.opt.step()
        self.partial = None


@ray.remote(num_cpus=0)
class Engine:
    """An inference replica: full weights, refitted in place."""

    def __init__(self, vocab: int, hidden: int, ffn: int):
        self.w = {"E": torch.zeros(vocab, hidden), "W1": torch.zeros(ffn, hidden),
                  "W2": torch.zeros(vocab, ffn)}

    def reshard_tensors(self):
        return self.w

    def logits(self, tokens):
        return torch.relu(self.w["E"][tokens] @ self.w["W1"].T) @ self.w["W2"].T

    def generate(self, prompt, n_new: int):
        """Greedy generation; returns the tokens and the logits at every position."""
        toks = list(prompt)
        for _ in range(n_new):
            toks.append(int(self.logits(torch.tensor(toks[-1:]))[-1].argmax()))
        return toks, self.logits(torch.tensor(toks))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--address", help="connect to this Ray cluster instead of starting one")
    args = ap.parse_args(argv)
    V, H, F = args.vocab, args.hidden, 4 * args.hidden
    g = torch.Generator().manual_seed(0)
    full = {"E": torch.randn(V, H, generator=g), "W1": torch.randn(F, H, generator=g) * H ** -0.5,
            "W2": torch.randn(V, F, generator=g) * F ** -0.5}
    lay = layouts()
    specs = {n: rr.TensorSpec(full[n].shape, torch.float32, src=s, dst=d)
             for n, (s, d) in lay.items()}
    # the "environment": next token = (token * 7 + 3) mod V, which the policy learns
    data = torch.randint(0, V, (args.batch,), generator=g)
    target = (data * 7 + 3) % V
    prompt = [int(t) for t in data[:4]]

    with connect(args.address):
        trainers = [Trainer.options(resources={"node0": 1}).remote(
            {n: rr.shard_tensor(full[n], lay[n][0], r) for n in full}, 1e-2) for r in range(TP)]
        engines = [Engine.options(resources={"node1": 1}).remote(V, H, F) for _ in range(DP)]
        with rr.ReshardGroup(trainers, engines) as group:
            print(group.plan(specs).summary())
            previous = None
            for step in range(1, args.steps + 1):
                parts = ray.get([t.forward.remote(data) for t in trainers])
                logits = sum(parts)                                   # the TP all-reduce
                loss = torch.nn.functional.cross_entropy(logits, target)
                grad = torch.softmax(logits, -1)
                grad[torch.arange(len(target)), target] -= 1
                grad /= len(target)
                ray.get([t.backward_step.remote(grad) for t in trainers])

                res = group.refit(specs)
                outs = ray.get([e.generate.remote(prompt, 8) for e in engines])
                toks = outs[0][0]
                want = sum(ray.get([t.forward.remote(torch.tensor(toks)) for t in trainers]))
                for d, (got_toks, got_logits) in enumerate(outs):
                    if got_toks != toks or not torch.allclose(got_logits, want, atol=1e-4, rtol=1e-4):
                        print(f"FAILED step {step}: engine {d} did not generate with the new weights")
                        return 1
                    if previous is not None and torch.allclose(got_logits, previous, atol=1e-6):
                        print(f"FAILED step {step}: engine {d} still generates with the old weights")
                        return 1
                versions = group.versions()
                if any(v != step for v in versions) or res.version != step:
                    print(f"FAILED step {step}: versions {versions}")
                    return 1
                previous = want
                print(f"step {step}: loss {loss.item():.4f}, refit v{res.version} "
                      f"{res.seconds * 1e3:.1f} ms, engines generated {toks[len(prompt):]} "
                      f"with the step-{step} weights")
    print(f"ok: {args.steps} steps, every generation used the weights of its step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
