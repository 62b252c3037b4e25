"""bench-vllm in its small mode: a live engine refit by ray-reshard and by gather + collective_rpc
on the same trainers and engine, both leaving it serving the same weights."""
import re
import subprocess
import sys

import pytest

from live import require_vllm

pytestmark = [pytest.mark.slow, pytest.mark.vllm_live, pytest.mark.timeout(900)]


def test_bench_vllm_small():
    require_vllm()
    p = subprocess.run([sys.executable, "-m", "ray_reshard", "bench-vllm", "--small"],
                       capture_output=True, text=True, timeout=880)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    out = p.stdout
    ours = re.search(r"ray-reshard .*?([\d.]+) s \(min.*?([\d.]+) MB moved", out)
    base = re.search(r"gather on rank 0 .*?([\d.]+) s \(min.*?([\d.]+) MB moved", out)
    assert ours and base, out
    assert float(ours.group(1)) > 0 and float(base.group(1)) > 0
    # the baseline moves the whole model at least once more than the refit (the gather)
    assert float(base.group(2)) > float(ours.group(2)), out
    assert "both leave the engine serving the same weights" in out
