"""sim_calibrate's fitted constants: the numbers its JSON carries are the cluster it predicts
with (no Ray: the measurements and the case refits are stood in for)."""
import contextlib
import json
import statistics

import pytest

from ray_reshard.tools.bench import sim_calibrate as sc
from ray_reshard.execution.program import PER_ITEM_MIN_BYTES
from ray_reshard.sim import Cluster, preset

N, R, CORES = sc.N, sc.ROUNDS, 2


def _measured(k: Cluster) -> dict:
    """The figures `measure` would return on a machine that behaves as `fit` models cluster
    `k` (a domain refit of 64 MB in 4 rounds, single-copy rings)."""
    per_round = 2 * N * k.item_s / CORES + 2 * N * k.tensor_s / CORES / R
    t_round = k.refit_overhead_s + k.latency_s + per_round
    t_many = t_round + 400 * 2 * N * (k.item_s + k.tensor_s) / CORES
    t_msgs1 = 0.05
    t_ring_round = 5e-3
    dom_bytes, dom_rounds = 64_000_000, 4
    return {"cores": CORES, "one_Bps": k.nic_Bps, "fabric_Bps": k.fabric_Bps,
            "t_round": t_round, "t_many": t_many,
            "t_cross": t_many + 400 * 3 * N * 2 * k.item_s / CORES,
            "t_msgs1": t_msgs1,
            "t_msgs64": t_msgs1 + 63 * N * 2 * (k.message_s + k.item_s + k.tensor_s) / CORES,
            "t_rounds": t_round + (R - 1) * (k.latency_s + per_round),
            "t_ring_round": t_ring_round,
            "t_ring_rounds": t_ring_round + (R - 1) * (k.ring_latency_s + per_round),
            "copy_Bps": k.copy_Bps, "contig_copy_Bps": k.contig_copy_Bps,
            "t_dom": (t_ring_round + dom_bytes / k.contig_copy_Bps / CORES
                      + (dom_rounds - 1) * k.ring_latency_s + dom_bytes / k.domain_fabric_Bps),
            "dom_rounds": dom_rounds, "single_copy": True, "dom_bytes": dom_bytes}


def test_fit_recovers_the_constants_and_builds_the_cluster_from_them():
    local = preset("local")
    constants, settings = sc.fit(_measured(local))
    assert list(constants) == list(sc.FITTED)
    for name, value in constants.items():
        assert type(value) is float
        assert value == pytest.approx(getattr(local, name), rel=1e-9), name
    assert settings == {"gpus_per_domain": N, "cpu_cores": CORES, "broadcast": "flat",
                        "per_item_min_bytes": PER_ITEM_MIN_BYTES, "single_copy_rings": True}
    cl = sc.fitted_cluster(constants, settings)
    for name, value in {**constants, **settings}.items():
        assert getattr(cl, name) == value, name
    with pytest.raises(ValueError, match="constants lack message_s"):
        sc.fitted_cluster({n: v for n, v in constants.items() if n != "message_s"}, settings)


def test_json_carries_each_runs_constants_and_their_medians(tmp_path, monkeypatch):
    """`--json FILE`: per run the fitted constants the run predicted with, and their medians
    over the runs under "constants", each a number under its Cluster field's name."""
    base = preset("local")
    runs = [_measured(base.with_(latency_s=base.latency_s * f, item_s=base.item_s * f,
                                 nic_Bps=base.nic_Bps / f)) for f in (1.0, 1.3, 0.8)]
    given, used = iter(runs), []
    monkeypatch.setattr(sc, "local_cluster", lambda nodes: contextlib.nullcontext())
    monkeypatch.setattr(sc, "holders", lambda n, node: [None] * n)
    monkeypatch.setattr(sc, "measure", lambda args, src, dst, near: next(given))

    def predict_cases(args, src, dst, local):
        used.append(local)
        return [{"case": "one", "strategy": "reshard", "ratio": 1.0}]

    monkeypatch.setattr(sc, "predict_cases", predict_cases)
    path = tmp_path / "calibrate.json"
    assert sc.main(["--runs", "3", "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    assert len(out["per_run"]) == len(used) == 3
    for run, measured, cl in zip(out["per_run"], runs, used):
        assert run["measured"] == measured
        assert run["constants"] == sc.fit(measured)[0]
        assert run["cluster"] == cl.describe()
        for name, value in {**run["constants"], **run["settings"]}.items():
            assert getattr(cl, name) == value, name
    assert list(out["constants"]) == list(sc.FITTED)
    for name, value in out["constants"].items():
        assert type(value) is float
        assert value == statistics.median(run["constants"][name] for run in out["per_run"])
    assert out["constants"]["latency_s"] == pytest.approx(base.latency_s)
    assert out["settings"] == out["per_run"][0]["settings"]
    sc.fitted_cluster(out["constants"], out["settings"])      # the preset's refresh builds


def test_settings_that_differ_over_runs_are_listed():
    constants = dict.fromkeys(sc.FITTED, 1.0)
    per_run = [{"constants": constants, "settings": {"single_copy_rings": v, "cpu_cores": 2}}
               for v in (True, False, True)]
    assert sc.over_runs(per_run)["settings"] == {"single_copy_rings": [True, False, True],
                                                 "cpu_cores": 2}


def test_json_path_checked_before_calibrating(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        sc.main(["--json", str(tmp_path / "missing" / "out.json")])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err
