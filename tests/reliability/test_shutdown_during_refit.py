"""ray.shutdown() from another thread while a refit runs: the refitting thread ends in an
error within seconds (the group's Ray instance is gone), it does not wait out the refit.

Each case runs in a driver process of its own (shutdown_probe.py) joined to the session's
cluster: this process's own Ray client stays fit for the tests that follow."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)
PROBE = os.path.join(os.path.dirname(__file__), "shutdown_probe.py")


@pytest.mark.parametrize("overlapped", [False, True])
def test_shutdown_in_another_thread_ends_the_refit_in_an_error(cluster, overlapped):
    p = subprocess.run([sys.executable, PROBE, cluster.address, "1" if overlapped else "0"],
                       capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["first_version"] == 1
    assert not out["thread_alive"], "the refitting thread is still blocked 15 s after " \
                                     "ray.shutdown()"
    assert out.get("error_type") == "RefitError", out
    assert "ray.shutdown()" in out["error"]
    assert out["seconds_after_shutdown"] < 10, out
    assert out["closed"]
