"""docs/engines.md's vLLM snippet runs as it is written, against an fp32 and a bf16 engine
(vLLM's CPU build), on the session's cluster."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from live import require_vllm

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm_live, pytest.mark.slow, pytest.mark.timeout(900)]


def snippet() -> str:
    text = (ROOT / "docs" / "engines.md").read_text()
    blocks = re.findall(r"```python\n(# refit_live_engine\.py.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/engines.md lost its refit_live_engine.py snippet"
    return blocks[0]


def test_the_documented_snippet_runs_as_written(cluster, tmp_path):
    require_vllm()
    path = tmp_path / "refit_live_engine.py"
    path.write_text(snippet())
    env = dict(os.environ, RAY_ADDRESS=cluster.address)
    procs = {dtype: subprocess.Popen([sys.executable, str(path), dtype], cwd=tmp_path, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for dtype in ("float32", "bfloat16")}
    for dtype, proc in procs.items():
        out, err = proc.communicate(timeout=800)
        assert proc.returncode == 0 and "refit done" in out, (dtype, out[-3000:], err[-3000:])
        # the report: the tied head follows the embedding, linear weights go through
        # load_weights (the CPU build repacks them)
        assert re.search(r"in place .*lm_head\.weight\s+\(tied to model\.embed_tokens\.weight\)",
                         out), out[-3000:]
        assert "through load_weights" in out
