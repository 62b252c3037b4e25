"""Each refit logs one line and exports Ray metrics (read back from the nodes' metrics agents);
results and plan statistics convert to dicts and Arrow tables."""
import json
import logging
import os
import subprocess
import sys

import pyarrow as pa
import pytest

import ray_reshard as rr
from metrics_probe import loaded_pair

PROBE = os.path.join(os.path.dirname(__file__), "metrics_probe.py")


def test_refit_metrics_log_and_tables(cluster, caplog):
    src, dst, spec, wrong = loaded_pair()
    with caplog.at_level(logging.INFO, logger="ray_reshard"), rr.ReshardGroup(src, dst) as group:
        results = [group.refit({"w": spec}) for _ in range(2)]
        with pytest.raises(ValueError):
            group.refit({"w": wrong})
    lines = [r.getMessage() for r in caplog.records if r.name == "ray_reshard"]
    assert [x for x in lines if x.startswith("refit v")] == [
        f"refit v{r.version} [reshard] {r.seconds:.3f} s: network "
        f"{r.bytes_by_path['network'] / 1e9:.3f} GB, domain 0.000 GB, local 0.000 GB, "
        f"{r.network_gbps:.2f} GB/s" for r in results]
    assert any(x.startswith("refit failed (ValueError)") for x in lines)

    res = results[-1]
    d = res.to_dict()
    assert d["version"] == 2 and d["network_bytes"] == res.bytes_by_path["network"] > 0
    assert d["plan_min_network_bytes"] == res.plan_stats.min_network_bytes
    t = res.to_arrow()
    assert isinstance(t, pa.Table) and t.num_rows == 1 and t.column("seconds")[0].as_py() == res.seconds
    both = pa.concat_tables([r.to_arrow() for r in results])
    assert both.column("version").to_pylist() == [1, 2]
    st = res.plan_stats.to_arrow()
    assert st.column("network_bytes")[0].as_py() == res.plan_stats.network_bytes
    assert res.plan_stats.to_dict()["n_tensors"] == 1


def test_refit_metrics_are_exported_through_the_metrics_agents(cluster):
    # A driver of its own (see metrics_probe.py): exactly its two refits and one refusal.
    p = subprocess.run([sys.executable, PROBE, cluster.address], capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["refused"]
    assert out["got"] is not None, "no complete scrape of the nodes' metrics agents"
    assert tuple(out["got"]) == tuple(out["want"]), out
