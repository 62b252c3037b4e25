"""The release tests' definitions are well formed, and their workload runs in CPU mode (gloo,
simulated nodes of the shared test cluster) end to end: every model refit, verified bit-exactly
with both strategies, a simulator prediction beside each measurement."""
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
REL = ROOT / "release_tests"


def test_release_tests_yaml():
    tests = yaml.safe_load((REL / "release_tests.yaml").read_text())
    names = [t["name"] for t in tests]
    assert len(names) == len(set(names)) >= 4
    for t in tests:
        for key in ("name", "group", "working_dir", "frequency", "team", "cluster", "run"):
            assert key in t, (t["name"], key)
        assert (ROOT / t["working_dir"]).is_dir()
        base = ROOT / t["working_dir"]
        assert (base / t["cluster"]["byod"]["post_build_script"]).is_file()
        compute = base / t["cluster"]["cluster_compute"]
        text = compute.read_text().replace('{{env["ANYSCALE_CLOUD_ID"]}}', "cloud")
        cfg = yaml.safe_load(text)
        assert cfg["head_node_type"] and cfg["worker_node_types"], compute
        run = t["run"]
        assert run["timeout"] > 0 and run["wait_for_nodes"]["num_nodes"] >= 1
        script = run["script"].split()
        assert script[0] == "python" and (base / script[1]).is_file(), run["script"]
        assert "--smoke" in t["smoke_test"]["run"]["script"]


def test_workload_cpu_mode(cluster, tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(REL / "workloads" / "refit_models.py"), "--mode", "cpu", "--smoke",
         "--gpus-per-side", "4", "--address", cluster.address, "--out", str(out)],
        cwd=REL, env=dict(os.environ, RAY_DEDUP_LOGS="0"), capture_output=True, text=True,
        timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["passed"] and [c["model"] for c in res["cases"]] == ["llama3", "qwen3-moe",
                                                                     "deepseek-v3"]
    assert res["train_nodes"] == res["infer_nodes"] == 1
    for c in res["cases"]:
        assert c["reshard"]["verified"] and c["gather_broadcast"]["verified"]
        assert c["reshard"]["network_bytes"] == c["min_network_bytes"]
        assert 0 < c["bound_s"] <= c["predicted_s"]
