"""The training function of the Ray Train tests, and what the tests run beside it.

`train_loop` is a ``train_loop_per_worker``: a tiny Qwen3 (loaded from a directory) trained with
FSDP2 or DDP and SGD on next-token loss over random batches, a checkpoint of the full weights
reported every step, then `WeightSync.push(step)` into the live engines. Restarted by Ray Train,
it restores the latest checkpoint and pushes those weights first. A fault can be planted: one
rank's process dies while the refit of a given step reads its shards (``os._exit`` inside its
tensors callable, which runs in the worker's actor during the refit), on the first attempt only.

`Generations` asks the engine for greedy completions in a thread while the trainer runs.
"""
import os
import sys
import tempfile
import threading
import time

import ray
import ray.cloudpickle
import torch

from live import MAX_TOKENS, PROMPTS

WEIGHTS = "model.safetensors"


def train_loop(config):
    import ray.train
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ray_reshard.integrations.ray_train import WeightSync
    from ray_reshard.models import fsdp_local_tensors

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(config["path"], dtype=torch.float32)
    start, restored = 0, ray.train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as d:
            model.load_state_dict(load_file(os.path.join(d, WEIGHTS)), strict=False)
            with open(os.path.join(d, "step")) as f:
                start = int(f.read())
    if config["parallel"] == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        hf = model
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        hf = model.module
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])

    now = {"step": start}
    fault = config.get("fault") if restored is None else None

    def tensors():
        if fault and rank == fault["rank"] and now["step"] == fault["step"]:
            os._exit(1)         # this worker dies while the refit reads its shards
        return fsdp_local_tensors(hf)

    sync = WeightSync(model, config["engines"], tensors=tensors, timeout_s=60.0,
                      delta=bool(config.get("delta")), group_options=config.get("group"))
    refits = []

    def push(step, **kw):
        result = sync.push(step, **kw)
        if result is not None:
            refits.append({"step": step, "version": result.version, "seconds": result.seconds,
                           "bytes": sum(result.bytes_by_path.values()), "delta": result.delta})

    push(start, force=True)             # the engines serve what this attempt starts from
    for step in range(start + 1, config["steps"] + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        ids = torch.randint(0, config["vocab_size"], (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        report(hf, rank, step, {"loss": float(loss)})
        now["step"] = step
        push(step)
    layout = repr(sync.train)
    sync.close()
    return {"refits": refits, "train": layout, "start": start}


def report(hf, rank, step, metrics):
    """ray.train.report of `metrics` with a checkpoint of the full weights (rank 0 writes it;
    gathering FSDP2 shards is a collective)."""
    import ray.train
    from safetensors.torch import save_file

    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in hf.named_parameters()}
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if rank == 0:
            save_file({n: t.contiguous() for n, t in full.items()}, os.path.join(d, WEIGHTS))
            with open(os.path.join(d, "step"), "w") as f:
                f.write(str(step))
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report({"step": step, **metrics}, checkpoint=checkpoint)


class Generations:
    """Greedy completions of PROMPTS from `engine`, asked for again and again in a thread:
    (version, token ids per prompt) in the order they came."""

    def __init__(self, engine, pause_s=0.2):
        self.engine, self.pause_s = engine, pause_s
        self.seen: list = []
        self.errors: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        from ray_reshard.engines.vllm.serving import generate

        while not self._stop.is_set():
            try:
                out = generate(self.engine, PROMPTS, MAX_TOKENS, timeout_s=120)
            except Exception as e:      # noqa: BLE001  (the test reads them)
                self.errors.append(f"{type(e).__name__}: {e}")
                return
            versions = {o["version"] for o in out}
            assert len(versions) == 1
            self.seen.append((out[0]["version"], [o["token_ids"] for o in out]))
            time.sleep(self.pause_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=180)


def checkpoints(result):
    """{step: full weights} of every checkpoint a run reported."""
    from safetensors.torch import load_file

    out = {}
    for ckpt, _ in result.best_checkpoints:
        with ckpt.as_directory() as d:
            with open(os.path.join(d, "step")) as f:
                out[int(f.read())] = load_file(os.path.join(d, WEIGHTS))
    return out



@ray.remote(num_cpus=0)
class Busy:
    """An actor that runs one call at a time, as Ray Train V1's workers do while their training
    function runs."""

    def check(self):
        from ray_reshard.integrations.actors import current_actor
        from ray_reshard.integrations.ray_train import check_takes_calls

        try:
            check_takes_calls(current_actor(), timeout_s=2.0)
        except RuntimeError as e:
            return str(e)
        return None


@ray.remote(num_cpus=0)
class Driver:
    """Stands for the trainer actor that drives an engine's update session."""

    def ping(self):
        return True


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
