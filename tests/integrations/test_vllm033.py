"""The backend against vLLM 0.33's weight-transfer modules: test_vllm_api.py run again in a
subprocess whose ``vllm`` is 0.33 (the wheel's Python modules, installed by bash .ci/install
into .venv/vllm-0.33; its GPU kernels are not needed for these tests)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_033 = ROOT / ".venv" / "vllm-0.33"


def test_backend_against_vllm_033():
    if not (VLLM_033 / "vllm").is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"vLLM 0.33's modules are not in {VLLM_033}; bash .ci/install puts them "
                        f"there")
        pytest.skip(f"needs vLLM 0.33's modules in {VLLM_033} (bash .ci/install)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(VLLM_033)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    version = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"],
                             env=env, capture_output=True, text=True, timeout=120)
    assert version.returncode == 0, version.stderr[-2000:]
    assert version.stdout.strip().startswith("0.33"), version.stdout
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(Path(__file__).with_name("test_vllm_api.py"))],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    tail = (run.stdout + run.stderr)[-3000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and "skipped" not in run.stdout, tail
