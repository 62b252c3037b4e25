"""A user's mistake on the command line is one line on stderr, exit status 2, naming the
argument and the fix; nothing is planned or drawn first."""
from __future__ import annotations

import subprocess
import sys

import pytest

from ray_reshard.tools.cli import BENCHES, OWN_PARSERS, main

SMALL = ["--model", "small-moe", "--train", "megatron:pp=2,ep=2,dp=2",
         "--infer", "vllm:tp=2,dp=2,ep=2", "--gpus-per-node", "2"]


def one_line_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        code = main(argv)
        raise SystemExit(code)           # commands that return their status instead
    assert e.value.code == 2, e.value.code
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert captured.out == ""
    return err


@pytest.mark.parametrize("cmd", ["plan", "simulate"])
@pytest.mark.parametrize("given, missing", [
    ([], ["--model", "--train", "--infer"]),
    (["--model", "small-moe"], ["--train", "--infer"]),
    (["--model", "small-moe", "--train", "megatron:pp=2"], ["--infer"]),
    (["--model", "small-moe", "--infer", "vllm:tp=2"], ["--train"]),
])
def test_layouts_are_required(cmd, given, missing, capsys):
    err = one_line_error([cmd, *given], capsys)
    assert "required" in err
    for flag in missing:
        assert flag in err, (flag, err)


def test_png_onto_a_file(tmp_path, capsys):
    f = tmp_path / "pictures"
    f.write_text("not a directory")
    err = one_line_error(["plan", *SMALL, "--png", str(f)], capsys)
    assert err == (f"ray-reshard plan: error: argument --png: {str(f)!r} is a file; give a "
                   f"directory (created if missing) (see --help)")


def test_png_under_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("")
    err = one_line_error(["plan", *SMALL, "--png", str(f / "sub")], capsys)
    assert "argument --png: cannot create directory" in err and str(f / "sub") in err


def test_png_without_matplotlib_names_the_viz_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # as if not installed
    err = one_line_error(["plan", *SMALL, "--png", str(tmp_path / "out")], capsys)
    assert err == ("ray-reshard plan: error: argument --png: --png needs matplotlib, which is "
                   "not installed: pip install 'ray-reshard[viz]' (see --help)")
    assert not (tmp_path / "out").exists()


def test_png_creates_the_directory(tmp_path, capsys):
    out = tmp_path / "a" / "b"
    assert main(["plan", *SMALL, "--png", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["domains.png", "tilings.png"]


@pytest.mark.parametrize("cmd", ["plan", "simulate"])
def test_model_path_that_is_missing_or_not_json(cmd, tmp_path, capsys):
    err = one_line_error([cmd, "--model", str(tmp_path / "nope.json"),
                          "--train", "megatron:pp=2", "--infer", "vllm:tp=2"], capsys)
    assert "--model" in err and "no such file: " + str(tmp_path / "nope.json") in err
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    err = one_line_error([cmd, "--model", str(bad), "--train", "megatron:pp=2",
                          "--infer", "vllm:tp=2"], capsys)
    assert "--model" in err and f"cannot read {bad}" in err


def test_json_output_path_checked_before_the_run(tmp_path, capsys):
    err = one_line_error(["bench-first-refit", "--json", str(tmp_path / "no" / "x.json")],
                         capsys)
    assert "argument --json" in err and "does not exist" in err
    err = one_line_error(["bench-first-refit", "--json", str(tmp_path)], capsys)
    assert "argument --json" in err and "is a directory" in err


@pytest.mark.parametrize("cmd", sorted(OWN_PARSERS))
def test_benchmarks_with_their_own_parsers_refuse_in_one_line(cmd, capsys):
    err = one_line_error([cmd, "--no-such-flag"], capsys)
    assert "unrecognized arguments: --no-such-flag" in err


def test_top_level_help_lists_every_command_with_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    commands = ["plan", "demo", "simulate", *BENCHES, *OWN_PARSERS]
    listed = {}
    for line in out.splitlines():
        words = line.split()
        if line.startswith("    ") and words and words[0] in commands:
            listed[words[0]] = line
    assert sorted(listed) == sorted(commands)


def test_a_real_process_prints_one_line():
    p = subprocess.run([sys.executable, "-m", "ray_reshard", "plan", "--model", "small-moe"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip() == ("ray-reshard plan: error: the following arguments are "
                                "required: --train, --infer (see --help)")


def test_plan_and_simulate_take_the_same_options(capsys):
    """--gpus-per-domain (and its alias), the dtype spellings, fp8 and FSDP trainers: the same
    in both commands."""
    import json

    from ray_reshard import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"ray-reshard {__version__}"
    out = {}
    for cmd in ("plan", "simulate"):
        for dom in ("--gpus-per-domain", "--gpus-per-node"):
            for dtype in ("bf16", "bfloat16", "fp8"):
                args = [cmd, "--model", "small-moe", "--train", "fsdp:shard=2",
                        "--infer", "vllm:tp=1", dom, "2", "--dtype", dtype, "--json"]
                if cmd == "simulate":
                    args += ["--cluster", "local", "--sensitivity", "off"]
                assert main(args) == 0
                out[cmd, dom, dtype] = json.loads(capsys.readouterr().out)
    for cmd in ("plan", "simulate"):
        # an fp8 engine receives one byte per quantised element (plus scales): fewer bytes
        bf16 = out[cmd, "--gpus-per-domain", "bf16"]
        fp8 = out[cmd, "--gpus-per-node", "fp8"]
        key = "network_bytes" if cmd == "simulate" else "lower_bound_bytes"
        assert fp8[key] < bf16[key] == out[cmd, "--gpus-per-node", "bfloat16"][key]
    err = one_line_error(["plan", *SMALL[:-2], "--dtype", "fp64"], capsys)
    assert "--dtype" in err and "bf16, bfloat16" in err
