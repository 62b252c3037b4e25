"""bench-delta: the trace's model and trainer, the synthetic perturbation, the goals, and a
small run of the command on a local cluster (delta vs dense on the same actors)."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from ray_reshard.tools.bench.delta_codec import codec_table, render_codec
from ray_reshard.tools.bench.delta_trace import GOAL_BYTES_AT_10, combine_runs, goals
from ray_reshard.tools.bench.trace_model import (ModelConfig, Synthetic, TinyGPT, Trainer,
                                                 changed_share, config_for, digest)
from ray_reshard.tools.bench.harness import MiB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM = r"([0-9][0-9,]*\.?[0-9]*)"


def test_config_sizes_the_model_and_shards_evenly():
    for mb in (4, 64, 256):
        cfg = config_for(mb)
        model = TinyGPT(cfg)
        n = sum(p.numel() for p in model.parameters())
        assert n == cfg.params
        assert abs(n * 2 / MiB - mb) <= max(0.15 * mb, 1)
        # TP4 row shards and TP2 halves need every first dimension divisible by 4
        assert all(p.shape[0] % 4 == 0 for p in model.parameters())


def test_trainer_keeps_bf16_weights_the_rounded_fp32_master():
    tr = Trainer(ModelConfig(vocab=64, d_model=32, heads=2, ffn=64, layers=1, seq=8, batch=2),
                 lr=1e-6)
    before = {n: t.clone() for n, t in tr.weights().items()}
    tr.step()
    for (name, low), master in zip(tr.weights().items(), tr.master.parameters()):
        assert low.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert torch.equal(low, master.detach().to(torch.bfloat16)), name
    # an RL-like learning rate moves the fp32 master by about lr per element: only elements
    # near a bf16 rounding boundary (or near zero) change in bf16
    share = changed_share(tr.weights(), before)
    assert 0 < share < 0.5
    moved = max(float((m.detach() - tr.weights()[n].float()).abs().max())
                for n, m in tr.master.named_parameters())
    assert moved < 0.1


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.5, 1.0])
def test_synthetic_changes_that_share_of_elements(fraction):
    s = Synthetic(config_for(4))
    before = {n: t.clone() for n, t in s.weights().items()}
    s.fraction = fraction
    s.step()
    share = changed_share(s.weights(), before)
    assert share == pytest.approx(fraction, abs=0.005)


def test_digest_is_of_the_bytes():
    a = torch.arange(8, dtype=torch.bfloat16).view(4, 2)
    assert digest([a[:2]]) == digest([a[:2].clone()]) != digest([a[2:]])
    b = a.clone()
    b.view(-1).view(torch.int16)[3] ^= 1
    assert digest([a]) != digest([b])


def test_goals_from_medians():
    spread = lambda v: {"median": v, "low": v, "high": v, "values": [v]}
    row = lambda f, db, ds: {"fraction": f, "delta_network_bytes": spread(db),
                             "dense_network_bytes": spread(100.0), "delta_s": spread(ds),
                             "dense_s": spread(1.0)}
    met = [g["met"] for g in goals([row(0.0, 0.0, 0.5), row(0.1, 20.0, 0.9),
                                    row(1.0, 100.0, 1.02)])]
    assert met == [True, True, True, True, False]             # the trace not measured
    rows = goals([row(0.1, 30.0, 1.2)])
    assert [g["met"] for g in rows] == [False] * 5
    assert rows[1]["measured"] == pytest.approx(0.3) and rows[0]["measured"] is None
    assert "--synthetic with 0" in rows[0]["needs"]
    trace = goals([row("trace", 5.0, 0.8)])
    assert trace[-1]["met"] and trace[-1]["measured"] == pytest.approx(0.8)
    assert GOAL_BYTES_AT_10 == 0.25


def test_runs_judge_each_goal_on_the_median_over_the_runs():
    spread = lambda v: {"median": v, "low": v, "high": v, "values": [v]}
    row = lambda f, ds: {"fraction": f, "delta_network_bytes": spread(10.0),
                         "dense_network_bytes": spread(100.0), "delta_s": spread(ds),
                         "dense_s": spread(1.0)}
    runs = [{"mode": "synthetic", "machine": {}, "goals": goals([row(0.0, s), row(0.1, 0.9),
                                                                 row(1.0, 1.0)])}
            for s in (0.5, 0.7, 0.55)]
    out = combine_runs(runs)
    at_0 = out["goals"][0]
    assert out["runs"] == 3 and at_0["runs"] == 3 and at_0["runs_met"] == 2
    assert at_0["measured"] == pytest.approx(0.55) and at_0["met"]     # 0.55 <= 0.6
    assert (at_0["low"], at_0["high"]) == (pytest.approx(0.5), pytest.approx(0.7))
    assert out["goals"][-1]["measured"] is None and "runs" not in out["goals"][-1]
    assert combine_runs(runs[:1])["runs"] == 1


def test_codec_line_meets_its_goals_shape():
    """The codec benchmark's figures (the goals are judged on the quiet-machine run): every
    fraction decodes to the new bytes (checked inside), the encodings follow the density."""
    rows = codec_table(nbytes=MiB, repeats=1)
    assert [r["encoding"] for r in rows] == ["same", "index", "index", "mask", "dense"]
    assert all(r["encode_GBps"] > 0 for r in rows) and rows[-1]["decode_GBps"] is None
    assert "goal: encode >= 4 GB/s" in render_codec(rows)


@pytest.fixture(scope="module")
def address(cluster):
    return cluster.address


def _run(*args, address):
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_RESHARD_CLUSTER_ADDRESS=address)
    p = subprocess.run([sys.executable, "-m", "ray_reshard", "bench-delta", "--small", *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def _rows(out):
    pat = re.compile(r"^\s+(\d+)\s+" + r"\s+".join([NUM] * 5) + r"x\s+" + NUM + r"\s+" + NUM
                     + r"\s+" + NUM + r"x\s+(\d+)/(\d+)/(\d+)/(\d+)\s+(\S+)$", re.M)
    return [m.groups() for m in pat.finditer(out)]


@pytest.mark.slow
def test_bench_delta_small(address, tmp_path):
    path = tmp_path / "delta.json"
    out = _run("--synthetic", "0,0.01,1.0", "--json", str(path), address=address)
    assert "first refit travelled dense" in out
    rows = _rows(out)
    assert len(rows) == 6, out                      # 2 steps at each of 3 fractions
    for row in rows:
        changed, delta_mb, dense_mb, bound_mb, ratio = map(float, row[1:6])
        assert row[-1] == "bit-identical"
        assert dense_mb == bound_mb > 0 and 0 <= delta_mb <= dense_mb
    at = lambda f: [r for r in rows if abs(float(r[1]) - f) < 0.005]
    assert all(float(r[2]) == 0 and int(r[9]) > 0 for r in at(0.0))        # all same
    assert all(float(r[2]) < 0.1 * float(r[3]) for r in at(0.01))           # few bytes
    assert all(float(r[2]) == float(r[3]) and int(r[12]) > 0 for r in at(1.0))  # dense
    assert "goals (ratios of medians):" in out and "not measured" in out   # no 0.1 here
    assert "quiet-machine wait before each timed refit" in out
    data = json.loads(path.read_text())
    for step in data["steps"]:
        d = step["delta"]
        assert d["network_bytes"] == step["delta_network_bytes"]
        assert d["dense_network_bytes"] == step["dense_network_bytes"]
        assert d["fallbacks"] == [] and step["verified"]
    assert data["codec"]["encode_GBps"] > 0 and data["codec"]["decode_GBps"] > 0
    assert {step["first"] for step in data["steps"]} == {"delta", "dense"}      # rotated


@pytest.mark.slow
def test_bench_delta_trace_small(address):
    out = _run(address=address)
    rows = _rows(out)
    assert len(rows) == 2, out
    for row in rows:
        changed, delta_mb, dense_mb = map(float, row[1:4])
        # lr 1e-6: a few percent of the bf16 elements change per step, and the delta refit
        # sends a small share of the dense bytes
        assert 0 < changed < 0.2 and 0 < delta_mb < 0.5 * dense_mb
        assert row[-1] == "bit-identical"
    assert "median [range] over the 2 steps of the trace" in out
