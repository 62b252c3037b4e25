"""The cluster simulator: closed-form cases, exact vs aggregate replay, bounds, the CLI."""
import json
import subprocess
import sys

import pytest
import torch

import ray_reshard as rr
from ray_reshard.sim import Cluster, gather_broadcast_seconds, preset, simulate
from ray_reshard.sim.cli import main as cli_main

GB = 1e9
BARE = Cluster("bare", 4, nvlink_Bps=100 * GB, nic_Bps=10 * GB, latency_s=0.0, item_s=0.0,
               tensor_s=0.0, refit_overhead_s=0.0)


def _tp4_to_tp2dp2(n=4, rows=4096, cols=1024):
    train = rr.Layout(rr.Mesh([0, 1, 2, 3]), (rr.Shard(0),))
    infer = rr.Layout(rr.Mesh([[0, 1], [2, 3]], ("dp", "tp")), (rr.Replicate(), rr.Shard(0)))
    return {f"w{i}": rr.TensorSpec((rows, cols), torch.float32, src=train, dst=infer)
            for i in range(n)}


def test_one_transfer_closed_form():
    lay = rr.Layout.replicated([0])
    specs = {"w": rr.TensorSpec((1000, 1000), torch.float32, src=lay, dst=lay)}
    p = rr.plan(specs, ["a"], ["b"])
    cl = BARE.with_(latency_s=1e-3, refit_overhead_s=2e-3)
    res = simulate(p, cl, bucket_bytes=1 << 30)
    assert res.predicted_s == pytest.approx(4e6 / (10 * GB) + 1e-3 + 2e-3)
    assert res.bound_s == pytest.approx(4e6 / (10 * GB))
    # four buckets: four rounds, each paying the latency once
    res4 = simulate(p, cl, bucket_bytes=1_000_000)
    assert res4.rounds == 4
    assert res4.predicted_s == pytest.approx(4e6 / (10 * GB) + 4e-3 + 2e-3)


def test_exact_and_aggregate_agree():
    specs = _tp4_to_tp2dp2()
    p = rr.plan(specs, ["n0"] * 4, ["n1"] * 4)
    ex = simulate(p, preset("dgx-h100"), 4 << 20, "exact")
    ag = simulate(p, preset("dgx-h100"), 4 << 20, "aggregate")
    assert ex.mode == "exact" and ag.mode == "aggregate"
    assert ag.predicted_s == pytest.approx(ex.predicted_s, rel=0.05)
    assert ag.bound_s == pytest.approx(ex.bound_s)
    assert ex.predicted_s >= ex.bound_s


def test_domain_aware_beats_direct_and_gather_broadcast():
    """TP4 -> TP2 x DP2 in one destination domain: each source shard crosses the network once
    instead of twice, then the replicas exchange over NVLink."""
    specs = _tp4_to_tp2dp2()
    aware = rr.plan(specs, ["n0"] * 4, ["n1"] * 4)
    direct = rr.plan(specs, n_src=4, n_dst=4)
    assert aware.stats.network_bytes * 2 == direct.stats.network_bytes
    a = simulate(aware, BARE, 1 << 20)
    d = simulate(direct, BARE.with_(gpus_per_domain=1), 1 << 20)
    assert a.predicted_s < 0.7 * d.predicted_s
    assert a.nvlink_bound_s > 0 and a.busiest_links
    assert gather_broadcast_seconds(aware, BARE, 1 << 20) > a.predicted_s
    assert a.timeline and all(r["end_s"] > r["start_s"] for r in a.timeline)


def test_item_costs_can_dominate():
    specs = _tp4_to_tp2dp2(n=64, rows=64, cols=64)
    p = rr.plan(specs, ["n0"] * 4, ["n1"] * 4)
    cheap = simulate(p, BARE, 1 << 20)
    costly = simulate(p, BARE.with_(item_s=1e-3), 1 << 20)
    assert costly.predicted_s > cheap.predicted_s + 0.05
    assert costly.cpu_s > 0


def test_cli_json(capsys):
    rc = cli_main(["--model", "llama70b", "--train", "megatron:tp=8,pp=4",
                   "--infer", "vllm:tp=8,dp=4", "--cluster", "dgx-h100", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for k in ("predicted_s", "bound_s", "gather_broadcast_s", "network_bytes", "min_network_bytes",
              "direct_s"):
        assert k in out
    assert out["network_bytes"] == out["min_network_bytes"]
    assert out["bound_s"] <= out["predicted_s"] < out["gather_broadcast_s"]


@pytest.mark.parametrize("argv, needle", [
    (["--model", "nope", "--train", "megatron:pp=2", "--infer", "vllm:tp=2"], "--model"),
    (["--model", "llama70b", "--train", "fsdp:pp=2", "--infer", "vllm:tp=2"], "--train"),
    (["--model", "llama70b", "--train", "megatron:pp=x", "--infer", "vllm:tp=2"], "pp must be"),
    (["--model", "llama70b", "--train", "megatron:pp=2", "--infer", "vllm:tp=2,ep=3"], "--infer"),
    (["--model", "llama70b", "--train", "megatron:pp=2", "--infer", "vllm:tp=2",
      "--cluster", "dgx-a1"], "unknown cluster"),
    (["--model", "llama70b", "--train", "megatron:pp=2"], "--infer"),
])
def test_cli_bad_arguments(capsys, argv, needle):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err


def test_cli_registered():
    proc = subprocess.run([sys.executable, "-m", "ray_reshard", "simulate", "--model", "llama70b",
                           "--train", "megatron:tp=8,pp=4", "--infer", "vllm:tp=8,dp=4,pp=0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("ray-reshard simulate: error: argument --infer")


def test_sim_imports_no_ray_and_no_runtime():
    code = ("import sys, ray_reshard.sim; "
            "assert 'ray' not in sys.modules and 'ray_reshard.runtime' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
