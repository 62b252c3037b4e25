"""Every example runs as a user would run it (a subprocess), in a small mode, and succeeds.

The examples connect to the session's shared two-node cluster (`--address`) rather than each
starting their own, and run side by side: most of their time is spent waiting for actors to
start, not computing."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "quickstart.py": (["--rows", "256", "--cols", "64"],
                      "verified: all 4 destination shards equal the full tensor's slices"),
    "rl_loop.py": (["--steps", "2"],
                   "ok: 2 steps, the engine served the trainers' new weights after every refit"),
    "dtensor_fsdp2.py": (["--dim", "32", "--steps", "2"],
                         "ok: engines hold the FSDP2 model's weights bit-exactly"),
    "megatron_to_vllm.py": (["--layers", "2", "--hidden", "64"],
                            "ok: the engines' model gives exactly the trainers' logits"),
    # the trainer's workers mostly wait: leave the shared cluster's CPUs to the others
    "ray_train_vllm.py": (["--steps", "2", "--cpus-per-worker", "0.01"],
                          "ok: 2 steps, the engine served the trainers' weights after every "
                          "refit"),
}


def test_every_example_is_tested():
    assert sorted(p.name for p in (ROOT / "examples").glob("*.py")) == sorted(CASES)


# Five examples side by side on two cores: 130 s on a quiet host, 285 s on a loaded one. The
# bound is for a hang, not a speed goal.
@pytest.mark.timeout(600)
def test_examples_run(cluster):
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    procs = {name: subprocess.Popen([sys.executable, str(ROOT / "examples" / name), *args,
                                     "--address", cluster.address], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (args, _) in CASES.items()}
    deadline = time.monotonic() + 540
    failures = []
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            failures.append(f"{name} timed out:\n{out[-2000:]}\n{err[-2000:]}")
            continue
        if proc.returncode != 0 or CASES[name][1] not in out:
            failures.append(f"{name} exited {proc.returncode}:\n{out[-2000:]}\n{err[-2000:]}")
    assert not failures, "\n\n".join(failures)


def test_example_reuses_the_callers_ray_session(cluster):
    """A user who already called ray.init() runs an example's main(): it uses that session and
    leaves it running (no "ray.init twice" error)."""
    script = (
        "import runpy, ray\n"
        f"ray.init(address={cluster.address!r}, log_to_driver=False)\n"
        f"main = runpy.run_path({str(ROOT / 'examples' / 'quickstart.py')!r})['main']\n"
        "code = main(['--rows', '256', '--cols', '64'])\n"
        "print('still connected:', ray.is_initialized(), 'exit', code)\n")
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "verified: all 4 destination shards" in p.stdout
    assert "still connected: True exit 0" in p.stdout


def test_unreachable_address_is_one_line_and_exit_2():
    import socket

    with socket.socket() as s:            # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = {name: subprocess.Popen([sys.executable, str(ROOT / "examples" / name), "--address",
                                     f"127.0.0.1:{port}"], cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name in CASES}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (name, out[-1000:], err[-1000:])
        err = err.strip().splitlines()
        assert len(err) == 1 and f"no Ray cluster answers at '127.0.0.1:{port}'" in err[0], err


def test_megatron_to_vllm_names_what_it_needs(monkeypatch, capsys):
    import runpy

    monkeypatch.setitem(sys.modules, "transformers", None)      # as if not installed
    main = runpy.run_path(str(ROOT / "examples" / "megatron_to_vllm.py"))["main"]
    assert main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("megatron_to_vllm: error: this example builds its model with transformers: "
                   "pip install 'transformers>=4.51'")


def test_examples_use_only_the_public_api():
    for path in (ROOT / "examples").glob("*.py"):
        text = path.read_text()
        assert "ray_reshard.tools.testing" not in text, path.name


def test_on_node_places_actors_by_the_clusters_node_resources(cluster):
    import ray_reshard as rr

    assert rr.on_node(0) == {"resources": {"node0": 1}}
    assert rr.on_node(1) == {"resources": {"node1": 1}}
    with pytest.raises(ValueError, match="node index"):
        rr.on_node(-1)
