"""Every example runs as a user would run it (a subprocess), in a small mode, and succeeds.

The examples connect to the session's shared two-node cluster (`--address`) rather than each
starting their own, and run side by side: most of their time is spent waiting for actors to
start, not computing."""
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "quickstart.py": (["--rows", "256", "--cols", "64"],
                      "verified: all 4 destination shards equal the full tensor's slices"),
    "rl_loop.py": (["--steps", "3", "--vocab", "64", "--hidden", "32"],
                   "ok: 3 steps, every generation used the weights of its step"),
    "dtensor_fsdp2.py": (["--dim", "32", "--steps", "2"],
                         "ok: engines hold the FSDP2 model's weights bit-exactly"),
    "megatron_to_vllm.py": (["--layers", "2", "--hidden", "64"],
                            "ok: the engines' model gives exactly the trainers' logits"),
}


def test_every_example_is_tested():
    assert sorted(p.name for p in (ROOT / "examples").glob("*.py")) == sorted(CASES)


def test_examples_run(cluster):
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    procs = {name: subprocess.Popen([sys.executable, str(ROOT / "examples" / name), *args,
                                     "--address", cluster.address], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (args, _) in CASES.items()}
    deadline = time.monotonic() + 300
    failures = []
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            failures.append(f"{name} timed out:\n{out[-2000:]}\n{err[-2000:]}")
            continue
        if proc.returncode != 0 or CASES[name][1] not in out:
            failures.append(f"{name} exited {proc.returncode}:\n{out[-2000:]}\n{err[-2000:]}")
    assert not failures, "\n\n".join(failures)
