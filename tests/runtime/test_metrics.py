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
    out, urls = [], set()
    for n in ray.nodes():
        if not n.get("Alive") or not n.get("MetricsExportPort"):
            continue
        url = f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
        if url in urls:
            continue
        urls.add(url)
        try:
            out.append(urllib.request.urlopen(url, timeout=5).read().decode())
        except OSError:
            pass
    return "\n".join(out)


def value(text: str, name: str, **tags) -> float:
    """Sum over `name`'s series (distinct label sets: a series two agents both export counts
    once) whose labels include `tags`."""
    series = {}
    for line in text.splitlines():
        m = re.match(rf"{name}{{(.*)}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in tags.items()):
            series[m.group(1)] = max(series.get(m.group(1), 0.0), float(m.group(2)))
    return sum(series.values())


def figures(text: str, me: str) -> tuple:
    """This driver's refits, network bytes, timed refits and ValueError failures as exported,
    then its domain bytes and gather-broadcast refits."""
    return (value(text, "ray_reshard_refits_total", WorkerId=me, strategy="reshard"),
            value(text, "ray_reshard_refit_bytes_total", WorkerId=me, strategy="reshard",
                  path="network"),
            value(text, "ray_reshard_refit_seconds_count", WorkerId=me, strategy="reshard"),
            value(text, "ray_reshard_refit_failures_total", WorkerId=me, kind="ValueError"),
            value(text, "ray_reshard_refit_bytes_total", WorkerId=me, path="domain"),
            value(text, "ray_reshard_refits_total", WorkerId=me, strategy="gather_broadcast"))


def settled(me: str) -> tuple:
    """This driver's exported figures once two scrapes 12 s apart agree: the counters belong to
    the process, so refits of earlier test modules in it are exported under this driver too."""
    prev, deadline = None, time.monotonic() + 120
    while True:
        cur = figures(scrape(), me)
        if cur == prev or time.monotonic() > deadline:
            return cur
        prev = cur
        time.sleep(12)


def test_refit_metrics_log_and_tables(cluster, caplog):
    src, dst = holders(2, 0), holders(2, 1)
    spec = rr.TensorSpec((64, 32), torch.float32, L([0, 1], Shard(0)), L([0, 1], Shard(1)))
    full = torch.randn(64, 32)
    ray.get([a.set.remote({"w": rr.shard_tensor(full, spec.src, r)}) for r, a in enumerate(src)])
    ray.get([a.set.remote({"w": torch.zeros(spec.dst.local_shape(r, spec.shape))})
             for r, a in enumerate(dst)])
    wrong = rr.TensorSpec((64, 33), torch.float32, spec.src, spec.dst)
    me = ray.get_runtime_context().get_worker_id()
    base = settled(me)
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

    # Exported through the metrics agent (every few seconds). Each sample carries the id of
    # the worker that recorded it, so the session's other drivers do not count; this process's
    # earlier refits do (see `settled`): the counts must grow by exactly this test's.
    net = sum(r.bytes_by_path["network"] for r in results)
    # ... and nothing under another strategy or path
    want = (2.0, float(net), 2.0, 1.0, 0.0, 0.0)
    deadline = time.monotonic() + 60
    while True:
        text = scrape()
        got = tuple(a - b for a, b in zip(figures(text, me), base))
        if got == want or any(g > w for g, w in zip(got, want)) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert got == want, (got, want, base, [x for x in text.splitlines()
                                           if me in x and "ray_reshard_refits_total" in x])
