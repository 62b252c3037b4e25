"""Every example runs as a user would run it (a subprocess), in a small mode, and succeeds."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_runs(name):
    args, expect = CASES[name]
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert expect in proc.stdout, proc.stdout[-3000:]
