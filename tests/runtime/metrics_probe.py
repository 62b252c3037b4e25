"""A driver that runs two refits and one refused refit, then reads its own refit metrics back
from the nodes' metrics agents; prints what it expected and what was exported, as one JSON
line.

Run as a process of its own (`python metrics_probe.py ADDRESS`): Ray's metric values belong to
the process, and after a reconnect (every test module's cluster fixture reconnects) a counter
is exported under the new driver with everything the process recorded before; a fresh driver
exports only its own refits.
"""
import json
import re
import sys
import time
import urllib.request

import ray
import torch

import ray_reshard as rr
from ray_reshard.layout.placement import Shard
from ray_reshard.tools.testing import holders


def L(ranks, *placements):
    return rr.Layout(rr.Mesh(ranks), placements)


def scrape() -> str:
    """Prometheus text from every node's metrics agent ("" when one of them did not answer:
    a partial scrape would undercount)."""
    out, urls = [], set()
    for n in ray.nodes():
        if not n.get("Alive") or not n.get("MetricsExportPort"):
            continue
        url = f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
        if url in urls:
            continue
        urls.add(url)
        try:
            out.append(urllib.request.urlopen(url, timeout=10).read().decode())
        except OSError:
            return ""
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


def loaded_pair():
    """Two sources (node 0) holding a 64x32 tensor's rows, two destinations (node 1) zeroed for
    its columns: (sources, destinations, its spec, a spec of the wrong shape)."""
    src, dst = holders(2, 0), holders(2, 1)
    spec = rr.TensorSpec((64, 32), torch.float32, L([0, 1], Shard(0)), L([0, 1], Shard(1)))
    full = torch.randn(64, 32)
    ray.get([a.set.remote({"w": rr.shard_tensor(full, spec.src, r)}) for r, a in enumerate(src)])
    ray.get([a.set.remote({"w": torch.zeros(spec.dst.local_shape(r, spec.shape))})
             for r, a in enumerate(dst)])
    return src, dst, spec, rr.TensorSpec((64, 33), torch.float32, spec.src, spec.dst)


def main(address: str) -> dict:
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    src, dst, spec, wrong = loaded_pair()
    me = ray.get_runtime_context().get_worker_id()
    with rr.ReshardGroup(src, dst) as group:
        results = [group.refit({"w": spec}) for _ in range(2)]
        try:
            group.refit({"w": wrong})
            refused = False
        except ValueError:
            refused = True
    net = sum(r.bytes_by_path["network"] for r in results)
    # ... and nothing under another strategy or path
    want = (2.0, float(net), 2.0, 1.0, 0.0, 0.0)
    # Exported through the metrics agent every few seconds (later on a loaded machine).
    got, text, deadline = None, "", time.monotonic() + 90
    while time.monotonic() < deadline:
        text = scrape()
        if text:
            got = figures(text, me)
            if got == want or any(g > w for g, w in zip(got, want)):
                break
        time.sleep(2)
    return {"refused": refused, "want": want, "got": got,
            "lines": [x for x in text.splitlines() if me in x and "ray_reshard_refit" in x]}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
