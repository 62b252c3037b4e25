"""Each refit logs one line and exports Ray metrics (read back from the nodes' metrics agents);
results and plan statistics convert to dicts and Arrow tables."""
import logging
import re
import time
import urllib.request

import pyarrow as pa
import pytest
import ray
import torch

import ray_reshard as rr
from ray_reshard.layout.placement import Shard
from ray_reshard.testing import holders


def L(ranks, *placements, names=None):
    return rr.Layout(rr.Mesh(ranks, names), placements)


def scrape() -> str:
    """Prometheus text from every node's metrics agent."""
    out = []
    for n in ray.nodes():
        if not n.get("Alive") or not n.get("MetricsExportPort"):
            continue
        url = f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
        try:
            out.append(urllib.request.urlopen(url, timeout=5).read().decode())
        except OSError:
            pass
    return "\n".join(out)


def value(text: str, name: str, **tags) -> float:
    """Sum of `name`'s samples whose labels include `tags` (all processes)."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}{{(.*)}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in tags.items()):
            total += float(m.group(2))
    return total


def test_refit_metrics_log_and_tables(cluster, caplog):
    src, dst = holders(2, 0), holders(2, 1)
    spec = rr.TensorSpec((64, 32), torch.float32, L([0, 1], Shard(0)), L([0, 1], Shard(1)))
    full = torch.randn(64, 32)
    ray.get([a.set.remote({"w": rr.shard_tensor(full, spec.src, r)}) for r, a in enumerate(src)])
    ray.get([a.set.remote({"w": torch.zeros(spec.dst.local_shape(r, spec.shape))})
             for r, a in enumerate(dst)])
    wrong = rr.TensorSpec((64, 33), torch.float32, spec.src, spec.dst)
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

    # Exported through the metrics agent (every few seconds); counts are per driver process and
    # other tests of this session refit too, hence "at least".
    net = sum(r.bytes_by_path["network"] for r in results)
    deadline = time.monotonic() + 60
    while True:
        text = scrape()
        got = (value(text, "ray_reshard_refits_total", strategy="reshard"),
               value(text, "ray_reshard_refit_bytes_total", strategy="reshard", path="network"),
               value(text, "ray_reshard_refit_seconds_count", strategy="reshard"),
               value(text, "ray_reshard_refit_failures_total", kind="ValueError"))
        if (got[0] >= 2 and got[1] >= net and got[2] >= 2 and got[3] >= 1) \
                or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert got[0] >= 2 and got[1] >= net and got[2] >= 2 and got[3] >= 1, got
