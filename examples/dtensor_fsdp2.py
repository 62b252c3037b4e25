"""A DTensor / FSDP2 source: trainers shard a model with torch.distributed's FSDP2
(`fully_shard`, gloo on CPU) inside Ray actors; the layouts come from the DTensors themselves
(`rr.Layout.from_dtensor`), and a refit moves the weights to tensor-parallel engines.

Four trainer actors on one node form a torch.distributed process group (gloo) and wrap a small
MLP with FSDP2: every parameter is a DTensor sharded on dim 0 over the 4 ranks. They take an
optimizer step, then two engines on another node receive the weights TP2 (first linear split by
output rows, second by input columns, biases as vLLM keeps them). The engines' shards are
checked bit-exactly against `DTensor.full_tensor()`.

    python examples/dtensor_fsdp2.py [--dim 256] [--steps 2] [--address HOST:PORT]

Without --address it uses the Ray session already started in this process, or else starts a
local two-node cluster on this machine (stopped at the end).
"""
import argparse
import socket
import sys

import ray
import torch

import ray_reshard as rr

WORLD, TP = 4, 2


def make_model(dim: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.ReLU(),
                               torch.nn.Linear(4 * dim, dim))


@ray.remote(num_cpus=0)
class FSDPTrainer:
    def __init__(self, rank: int, world: int, master: str, dim: int):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=master, rank=rank, world_size=world)
        self.rank = rank
        self.mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        self.model = make_model(dim)
        for layer in self.model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=self.mesh)
        fully_shard(self.model, mesh=self.mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.dim = dim

    def step(self, seed: int) -> float:
        """One optimizer step on this rank's slice of a batch (FSDP2 reduce-scatters grads)."""
        g = torch.Generator().manual_seed(seed * 100 + self.rank)
        x = torch.randn(16, self.dim, generator=g)
        loss = (self.model(x) - x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()

    def layouts(self) -> dict:
        """name -> (global shape, Layout) taken from each parameter's DTensor."""
        return {n: (tuple(p.shape), rr.Layout.from_dtensor(p))
                for n, p in self.model.named_parameters()}

    def reshard_tensors(self):
        # the local shard of each DTensor, looked up at every refit (FSDP2 may swap storages)
        return {n: p.to_local().detach() for n, p in self.model.named_parameters()}

    def full(self) -> dict:
        """The full parameters (a collective: call on every rank)."""
        return {n: p.full_tensor().detach() for n, p in self.model.named_parameters()}


@ray.remote(num_cpus=0)
class Engine:
    def __init__(self, shapes: dict):
        self.w = {n: torch.zeros(s) for n, s in shapes.items()}

    def reshard_tensors(self):
        return self.w

    def weights(self):
        return self.w


def engine_layouts(names) -> dict:
    """vLLM-style TP2: the first linear column-parallel, the second row-parallel."""
    mesh = rr.Mesh([0, 1], ("tp",))
    style = {"0.weight": rr.Shard(0), "0.bias": rr.Shard(0), "2.weight": rr.Shard(1),
             "2.bias": rr.Replicate()}
    return {n: rr.Layout(mesh, (style[n],)) for n in names}


def train_and_refit(dim: int, steps: int) -> int:
    """FSDP2 trainers on node 0, TP2 engines on node 1; a refit after each optimizer step."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    trainers = [FSDPTrainer.options(**rr.on_node(0)).remote(r, WORLD, master, dim)
                for r in range(WORLD)]
    src_layouts = ray.get(trainers[0].layouts.remote())
    dst_layouts = engine_layouts(src_layouts)
    for n, (shape, lay) in src_layouts.items():
        print(f"{n:<9} {str(shape):<12} trainer {lay}  ->  engine {dst_layouts[n]}")
    specs = {n: rr.TensorSpec(shape, torch.float32, src=lay, dst=dst_layouts[n])
             for n, (shape, lay) in src_layouts.items()}
    engines = [Engine.options(**rr.on_node(1)).remote(
        {n: dst_layouts[n].local_shape(r, shape) for n, (shape, _) in src_layouts.items()})
        for r in range(TP)]
    with rr.ReshardGroup(trainers, engines) as group:
        for step in range(1, steps + 1):
            losses = ray.get([t.step.remote(step) for t in trainers])
            res = group.refit(specs)
            full = ray.get([t.full.remote() for t in trainers])[0]
            got = ray.get([e.weights.remote() for e in engines])
            for r in range(TP):
                for n, t in got[r].items():
                    if not torch.equal(t, rr.shard_tensor(full[n], dst_layouts[n], r)):
                        print(f"FAILED step {step}: engine {r} {n} differs from the DTensor")
                        return 1
            print(f"step {step}: mean loss {sum(losses) / len(losses):.4f}; {res.summary()}")
    print(f"ok: engines hold the FSDP2 model's weights bit-exactly after each of {steps} steps")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--address", help="Ray cluster to join (default: this process's Ray session, "
                                      "or a local two-node cluster)")
    args = ap.parse_args(argv)
    try:
        with rr.connect(args.address):
            return train_and_refit(args.dim, args.steps)
    except rr.ClusterUnreachable as e:
        print(f"dtensor_fsdp2: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
