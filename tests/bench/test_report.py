"""The benchmark harness (spread, store sizing, the spill check) and the generated page."""
import os
import re
import subprocess
import sys

import pytest

from ray_reshard.tools.bench import report
from ray_reshard.tools.bench.harness import MiB, Spread, settle, store_bytes_for
from ray_reshard.tools.bench.peers import combine_runs, goals, ratios, shape_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_spread_and_store_sizing():
    s = Spread([0.3, 0.1, 0.2, 0.5, 0.4])
    assert (s.median, s.low, s.high) == (0.3, 0.1, 0.5)
    assert s.text() == "0.300 [0.100-0.500]"
    assert store_bytes_for(256 * MiB) >= 2 * 256 * MiB
    assert store_bytes_for(MiB) == 512 * MiB
    assert shape_for(256, 4096) == (16, 1024)
    with pytest.raises(ValueError, match="multiple of 4"):
        shape_for(8, 1024)


def _peers_row(reshard, store, raw, network=100, raw_bytes=100):
    p = lambda t: {"median": t, "low": t, "high": t, "values": [t]}
    return {"tensors": 32, "shape": [64, 1024], "network_bytes": network, "raw_bytes": raw_bytes,
            "peers": {"reshard": p(reshard), "object store": p(store),
                      "gather-broadcast": p(3 * reshard),
                      "raw point-to-point, bucket-sized messages": p(raw),
                      "raw point-to-point, one message per pair": p(2 * raw)}}


def test_goals_say_met_or_not_from_the_medians():
    row = _peers_row(reshard=1.0, store=2.5, raw=0.8)
    r = ratios(row)
    assert r["object store"] == 2.5 and r["raw share"] == pytest.approx(0.8)
    met = {g["goal"]: g["met"] for g in goals({"counts": {"32": row}})}
    assert met == {"reshard >= 2x the object store, 32 tensors": True,
                   "reshard >= 0.85 of raw point-to-point, 32 tensors": False}
    # raw moved half of reshard's network bytes: its time counts double
    assert ratios(_peers_row(1.0, 2.0, 0.5, network=100, raw_bytes=50))["raw share"] == 1.0
    page = "\n".join(report.render_peers({"json": {
        "layout": "L", "mb": 1, "store_bytes_per_node": {"node0": MiB}, "repeats": 1,
        "rdt": "not run: x", "counts": {"32": row}, "goals": goals({"counts": {"32": row}})}}))
    assert "**not met**" in page and "| met |" in page and "not run" in page


def test_first_refit_page_shows_medians_with_their_range():
    row = {"model": "M", "tensors": 10.0, "specs_s": 0.4, "lookup_s": 0.01, "plan_s": 0.1,
           "turns_s": 0.0, "turns": False, "put_s": 0.05, "driver_s": 0.56,
           "driver_s_range": [0.5, 0.7], "shipped_mb": 1.0, "load_s": 0.01,
           "install_dst_s": 0.2, "install_src_s": 0.1, "busiest_s": 0.21,
           "busiest_s_range": [0.2, 0.31]}
    goal = {"goal": "busiest install s <= 0.3", "measured": 0.21, "met": True, "low": 0.2,
            "high": 0.31, "runs": 3, "runs_met": 2}
    page = "\n".join(report.render_first_refit({"json": {"rows": {"8->8": row},
                                                         "goals": [goal], "repeats": 3}}))
    assert "| **0.56** [0.50-0.70] |" in page and "| **0.21** [0.20-0.31] |" in page
    assert "median of 3 measurements" in page
    assert "| 0.21 [0.20-0.31] | met (2 of 3 runs) |" in page


def _run_out(row):
    return {"mb": 1, "repeats": 5, "bucket_mb": 16, "layout": "L", "machine": {},
            "store_bytes_per_node": {"node0": MiB}, "rdt": "not run: x",
            "counts": {"32": dict(row, settle={"runs": 5, "waited_s": 0.3, "not_quiet": 0},
                                  spill={"spilled_bytes": 0, "restored_bytes": 0})}}


def test_runs_combine_into_medians_of_run_medians_with_their_range():
    outs = [_run_out(_peers_row(reshard=1.0, store=s, raw=0.8)) for s in (1.8, 2.2, 2.6)]
    out = combine_runs(outs)
    row = out["counts"]["32"]
    assert out["runs"] == 3 and row["peers"]["object store"]["values"] == [1.8, 2.2, 2.6]
    assert (row["peers"]["object store"]["low"], row["peers"]["object store"]["high"]) == \
        (1.8, 2.6)
    assert ratios(row)["object store"] == pytest.approx(2.2)    # median of the runs' ratios
    store_goal = out["goals"][0]
    assert store_goal["met"] and (store_goal["runs_met"], store_goal["runs"]) == (2, 3)
    assert row["settle"]["runs"] == 15
    page = "\n".join(report.render_peers({"json": out}))
    assert "| 2.20x [1.80-2.60] |" in page and "median over 3 runs" in page
    assert "| 2.20 [1.80-2.60] | met (2 of 3 runs) |" in page
    assert combine_runs(outs[:1])["runs"] == 1           # one run: its own figures


def test_rise_is_the_median_of_each_rounds_difference_in_the_larger_case():
    from ray_reshard.tools.bench.peers import render_row, reshard_rise
    from ray_reshard.tools.bench.peers_case import RISE_BASE

    def counts(fewer_s, more_s, rounds_ms):
        a = _peers_row(reshard=fewer_s, store=1.0, raw=0.1)
        b = _peers_row(reshard=more_s, store=1.0, raw=0.1)
        if rounds_ms is not None:
            b["rise"] = {"from": 1024, "to": 4096, "ms_by_round": rounds_ms}
            b["peers"][RISE_BASE] = dict(a["peers"]["reshard"])
        return {"counts": {"1024": a, "4096": b}}

    # both in each round: the median of the rounds' differences, not of the two cases
    assert reshard_rise(counts(0.100, 0.200, [12.0, 30.0, 15.0]), "1024", "4096").values == \
        [15.0]
    # an output without the paired figures: the two cases' medians (older raw outputs)
    assert reshard_rise(counts(0.100, 0.125, None), "1024", "4096").values == \
        [pytest.approx(25.0)]
    out = counts(0.1, 0.2, [12.0, 30.0, 15.0])
    del out["counts"]["1024"]                  # measured inside the 4096 case alone
    rise = [g for g in goals(out) if "rise" in g["goal"]]
    assert len(rise) == 1 and rise[0]["met"] and rise[0]["measured"] == 15.0
    runs = [_run_out(counts(0.1, 0.2, ms)["counts"]["4096"]) for ms in ([5.0], [25.0], [21.0])]
    for o in runs:
        o["counts"] = {"4096": o["counts"]["32"]}
    combined = combine_runs(runs)
    assert reshard_rise(combined, "1024", "4096").values == [5.0, 25.0, 21.0]
    assert "the rise's goal: the median of the rounds' differences" in \
        "\n".join(report.render_peers({"json": combined}))
    assert "rise from 1024 tensors" in render_row(combined["counts"]["4096"])


def test_settle_waits_for_a_quiet_machine_and_gives_up_at_its_limit():
    import threading
    import time

    waited = settle(quiet=1.01, window_s=0.01)           # never busier than all CPUs: at once
    assert 0.0 < waited < 0.5
    stop = time.perf_counter() + 1.0

    def spin():
        while time.perf_counter() < stop:
            pass

    busy = threading.Thread(target=spin)
    busy.start()
    try:
        # a busy machine (quiet means under 0.1% busy here): waits its limit, then goes on
        assert 0.2 <= settle(quiet=0.001, window_s=0.02, limit_s=0.2) < 0.9
    finally:
        busy.join()


@pytest.mark.slow
def test_spill_fails_loudly():
    """An object store too small for what is put spills, and the check says so."""
    import numpy as np
    import ray

    from ray_reshard.tools.bench.harness import SpillCheck
    from ray_reshard.tools.testing import local_cluster

    env = os.environ.pop("RAY_RESHARD_CLUSTER_ADDRESS", None)
    try:
        with local_cluster(1, store_bytes=80 * MiB):
            check = SpillCheck(ray.get_runtime_context().gcs_address)
            assert check.check("nothing yet") == {"spilled_bytes": 0, "restored_bytes": 0}
            refs = [ray.put(np.ones(30 * MiB, dtype=np.uint8)) for _ in range(5)]
            with pytest.raises(RuntimeError, match="spilled"):
                check.check("five 30 MiB objects")
            del refs
    finally:
        if env is not None:
            os.environ["RAY_RESHARD_CLUSTER_ADDRESS"] = env


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_report_small_writes_the_page(tmp_path):
    """The page generator in its small mode: each section's command, a table from its output,
    the date, commit and machine. Sections whose small command another test runs are left out
    (CI runs each command once); their tables render in the kept page's test."""
    run_elsewhere = {"first-refit": "test_bench_first_refit_small",
                     "delta": "test_bench_delta_small", "replay": "test_bench_replay_small",
                     "published": "test_sim_published_row"}
    small = [n for n, section in report.SECTIONS.items()
             if section[2] is not None and n not in run_elsewhere]
    out = tmp_path / "benchmarks.md"
    p = subprocess.run([sys.executable, "-m", "ray_reshard.tools.bench.report", "--small", "--out",
                        str(out), "--keep", str(tmp_path / "raw"), "--sections", ",".join(small)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    page = out.read_text()
    assert "**Small mode**" in page and "do not edit by hand" in page
    assert "shaped-peers" in small and "shaped-delta" not in small
    for name in report.SECTIONS:
        assert (f"`{report.command_line(name, True)}`" in page) == (name in small), name
    assert re.search(r"\| 32 x 128x1024 \| [0-9.]+ \[[0-9.]+-[0-9.]+\]", page)
    assert re.search(r"reshard >= 2x the object store, 32 tensors \| [0-9.]+ \[[0-9.]+-[0-9.]+\] "
                     r"\| (met|\*\*not met\*\*) \(\d of 2 runs\)", page)
    assert re.search(r"delta refit time <= 0.9 x dense, RL trace +[0-9.]+ \[[0-9.]+-[0-9.]+\] +"
                     r"(met|NOT met) \(\d of 2 runs\)", page)        # bench-delta --runs 2
    assert "bound from the layouts alone" in page and "| assumed |" in page
    assert re.search(r"\d of \d reshard predictions within 25% \(median over the runs\)", page)
    # rendering again from the kept outputs gives the same page
    again = tmp_path / "again.md"
    subprocess.run([sys.executable, "-m", "ray_reshard.tools.bench.report", "--from",
                    str(tmp_path / "raw"), "--out", str(again)], cwd=ROOT, check=True,
                   capture_output=True, timeout=120)
    assert again.read_text() == page
    # --check sets a run's figures beside the kept ones' stated spread (here the run against
    # itself, from its kept outputs: every figure inside its own prediction)
    p = subprocess.run([sys.executable, "-m", "ray_reshard.tools.bench.report", "--check", "--from",
                        str(tmp_path / "raw"), "--sections", "peers", "--against",
                        str(tmp_path / "raw")], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    m = re.search(r"(\d+) of (\d+) figures inside the page's 95% prediction", p.stdout)
    assert m and int(m[1]) == int(m[2]) == 6, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.returncode == 0
    assert again.read_text() == page          # nothing written to the page


def _kept(name):
    import json

    with open(os.path.join(report.RESULTS, f"{name}.out.json")) as f:
        return json.load(f)


def test_the_page_is_what_its_kept_outputs_render():
    """docs/benchmarks.md is exactly the rendering of docs/benchmark-results: no figure on the
    page can drift from the command outputs it was made from."""
    import json

    with open(os.path.join(report.RESULTS, "meta.json")) as f:
        meta = json.load(f)
    results = {n: _kept(n) for n in report.SECTIONS}
    page = report.render(results, meta["small"], meta["facts"], meta["commit"])
    with open(report.PAGE) as f:
        assert f.read() == page + "\n"


def test_check_compares_a_fresh_run_with_the_pages_prediction():
    import copy

    page = _kept("peers")
    figures = report.stated_figures("peers", page)
    # two goals per count, the fair pair's three and the rise from 1024 to 4096 tensors
    assert len(figures) == 2 * len(page["json"]["counts"]) + 4
    for f in figures:
        lo, hi = f["predicted"]
        assert lo <= f["low"] <= f["median"] <= f["high"] <= hi   # wider than the range
    same = report.compare("peers", page, page)
    assert all(x["inside"] and x["in_range"] and x["same_verdict"] for x in same)
    fresh = copy.deepcopy(page)
    row = next(iter(fresh["json"]["counts"].values()))
    for run in row["ratios_by_run"]:                # every run far below the 2x goal
        run["object store"] = 1.0
    rows = report.compare("peers", page, fresh)
    assert [x["inside"] for x in rows].count(False) == 1 and not rows[0]["inside"]
    assert not rows[0]["in_range"] and not rows[0]["same_verdict"]
    text = "\n".join(report.check_text(rows, "run at x"))
    assert "| **no** | **no** | **changed** |" in text
    n = len(rows)
    assert f"{n - 1} of {n} figures inside the page's 95% prediction; {n - 1} of {n} inside" \
        in text
    # a figure this run does not state counts as outside
    del fresh["json"]["counts"][next(iter(fresh["json"]["counts"]))]
    assert report.compare("peers", page, fresh)[0]["now"] is None
    # calibration ratios and first-refit goals are stated with their spread too
    assert all(f["predicted"] for f in report.stated_figures("calibrate", _kept("calibrate")))
    assert all(f["predicted"] for f in report.stated_figures("first-refit",
                                                             _kept("first-refit")))
    replay = _kept("replay")
    stated = report.stated_figures("replay", replay)
    assert stated and all(f["predicted"] and f["met"] is None for f in stated)
    for x in replay["json"]["figures"]:        # one measurement each: nothing stated
        x.update(runs=1, values=x["values"][:1])
    assert report.stated_figures("replay", replay) == []


def test_predicted_range_is_students_t():
    from ray_reshard.tools.bench.harness import predicted_range

    lo, hi = predicted_range([1.0, 2.0, 3.0])        # mean 2, sd 1, t(2 df) = 4.303
    assert (lo, hi) == pytest.approx((2 - 4.303 * (4 / 3) ** 0.5, 2 + 4.303 * (4 / 3) ** 0.5))
    lo, hi = predicted_range([float(v) for v in range(41)])   # 40 df: t = 2.021
    half = hi - 20
    sd = (41 * 42 / 12) ** 0.5
    assert half == pytest.approx(2.021 * sd * (42 / 41) ** 0.5, rel=2e-3)
    with pytest.raises(ValueError, match="2 values"):
        predicted_range([1.0])


def test_check_from_kept_outputs_writes_the_comparison(tmp_path, capsys):
    """`--check --from DIR` compares kept outputs without running anything; `--out` writes the
    comparison as a page; the exit status says whether every figure fell inside."""
    import json
    import shutil

    fresh = tmp_path / "fresh"
    shutil.copytree(report.RESULTS, fresh)
    out = tmp_path / "reproduction.md"
    assert report.main(["--check", "--from", str(fresh), "--out", str(out)]) == 0
    n = sum(len(report.stated_figures(s, _kept(s))) for s in report.CHECKED)
    assert f"{n} of {n} figures inside the page's 95% prediction" in out.read_text()
    path = fresh / "first-refit.out.json"
    r = json.loads(path.read_text())
    r["json"]["goals"][0]["measured"] = r["json"]["goals"][0]["high"] * 2
    path.write_text(json.dumps(r))
    assert report.main(["--check", "--from", str(fresh), "--sections", "first-refit"]) == 1
    assert "| **no** |" in capsys.readouterr().out
    (fresh / "peers.out.json").unlink()
    with pytest.raises(SystemExit):
        report.main(["--check", "--from", str(fresh), "--sections", "peers"])
