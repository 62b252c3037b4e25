"""Mutation pass: flip one decision of the planner, the executor or the recipes at a time and
check that some test fails on it.

Each mutant is an exact text replacement in one source file (it must occur exactly once, else
the mutant is reported stale). The repository's last commit (or, with --working-tree, the
files as they are now) is copied once to a temporary folder;
each mutant is applied to that copy, the tests that guard it run there (with the copy first
on PYTHONPATH, Ray workers included), and the file is restored. The working tree is never
touched.

    .venv/bin/python tests/mutation/run_mutations.py              # every mutant
    .venv/bin/python tests/mutation/run_mutations.py --only R1 P2 # some
    .venv/bin/python tests/mutation/run_mutations.py --list

A mutant is killed when its tests fail (pytest exit status 1); survived when they pass;
an exit status other than 0 or 1 (collection error, interruption, timeout) is reported as
such and counts as not killed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

PLANNING = ["tests/planning/test_lower_bound_oracle.py", "tests/planning/test_planner_cases.py",
            "tests/planning/test_planner_props.py"]
EXECUTION = ["tests/planning/test_planner_props.py", "tests/execution/test_program.py"]
RECIPES = ["tests/models/test_engine_layouts.py", "tests/models/test_model_refit.py"]


@dataclass(frozen=True)
class Mutant:
    id: str
    what: str
    path: str
    edits: tuple          # ((old, new), ...), each old exactly once in the file
    tests: tuple          # pytest arguments


MUTANTS = [
    # ---------------------------------------------------------------- planner and layout
    Mutant("P1", "planner: a far domain's receiver skips the forward to its replicas",
           "ray_reshard/planning/planner.py",
           (("                    if other != receiver:\n",
             "                    if other != receiver and False:\n"),),
           tuple(PLANNING)),
    Mutant("P2", "planner: every rank of a far domain takes the whole region over the network",
           "ray_reshard/planning/planner.py",
           (("        return list(zip(rs, cut))",
             "        return [(r, x) for r in rs]"),),
           tuple(PLANNING)),
    Mutant("P3", "planner: a source in the destination's own domain is ignored",
           "ray_reshard/planning/planner.py",
           (("                near = near_of.get(dom)\n", "                near = None\n"),),
           tuple(PLANNING)),
    Mutant("P4", "lower bound: what a domain's sources hold is not subtracted",
           "ray_reshard/planning/bound.py",
           (("        for blk in held:\n", "        for blk in ():\n"),),
           tuple(PLANNING)),
    Mutant("P5", "planner: replica choice always takes the first holder (no balancing)",
           "ray_reshard/planning/planner.py",
           (("        self.picked.add(best)\n",
             "        best = holders[0]\n        self.picked.add(best)\n"),),
           tuple(PLANNING)),
    Mutant("L1", "box: an off-by-one in split (the first pieces one row longer)",
           "ray_reshard/layout/box.py",
           (("            length = base + (1 if i < extra else 0)",
             "            length = base + (1 if i <= extra else 0)"),),
           tuple(PLANNING)),
    # ---------------------------------------------------------------- executor
    Mutant("E1", "program: an item's region not taken relative to the shard's origin",
           "ray_reshard/execution/program.py",
           (("slice(a - o, a - o + m) for a, o, m in zip(box.offsets, origin, sizes)",
             "slice(a, a + m) for a, o, m in zip(box.offsets, origin, sizes)"),),
           tuple(EXECUTION)),
    Mutant("E2", "program: contiguous items staged instead of sent in place",
           "ray_reshard/execution/part.py",
           (("                          and r.is_contiguous() and (not sending or r.dtype == w)",
             "                          and r.is_contiguous() and False"),),
           ("tests/runtime/test_refit.py", "-k", "strided")),
    Mutant("E3", "executor: a local copy (source and destination in one process) skipped",
           "ray_reshard/runtime/executor.py",
           (("            s.recv.copy_from(s.send)\n", "            pass\n"),),
           ("tests/runtime/test_refit.py", "-k", "colocated")),
    Mutant("E4", "worker: an atomic commit leaves the staged shards unswapped",
           "ray_reshard/runtime/worker.py",
           (("        _swap(target, staged)\n", "        pass\n"),),
           ("tests/reliability/test_atomic.py", "-k", "success")),
    Mutant("E5", "program: contiguous runs of one storage merged across a gap",
           "ray_reshard/execution/part.py",
           (("                        and prev.storage_offset() + prev.numel() == r.storage_offset()):",
             "                        ):"),),
           ("tests/execution/test_program.py",)),
    Mutant("P6", "planner: a local copy taken from the domain's first holder, on another device",
           "ray_reshard/planning/planner.py",
           ((" " * 24 + "moves.append(new_move(self.src_eps[same[0]], r, x, LOCAL))",
             " " * 24 + "moves.append(new_move(self.src_eps[near[0]], r, x, LOCAL))"),),
           tuple(PLANNING)),
    # ---------------------------------------------------------------- protocol and faults
    Mutant("A1", "worker: a rollback restores only the first staged tensor",
           "ray_reshard/runtime/worker.py",
           (("        for target, saved in pairs:\n", "        for target, saved in pairs[:1]:\n"),),
           ("tests/reliability/test_protocol.py", "-k", "dying_in_commit")),
    Mutant("T1", "group: its own timeout_s wins over a refit's",
           "ray_reshard/runtime/protocol.py",
           (("        timeout = timeout_s or self.timeout_s\n",
             "        timeout = self.timeout_s or timeout_s\n"),),
           ("tests/reliability/test_faults.py", "-k", "own_timeout")),
    # ---------------------------------------------------------------- vLLM backend
    Mutant("V1", "vLLM backend: an LM head's GEMM not probed (its packed copy taken as read)",
           "ray_reshard/engines/vllm/routes.py",
           (("    if lm_head or not embedding:", "    if not embedding:"),),
           ("tests/integrations/test_vllm_api.py", "-k", "route")),
    Mutant("V2", "vLLM backend: a tied LM head's packed copy not rebuilt after a round",
           "ray_reshard/engines/vllm/backend.py",
           (("        self.repacked = repack_modules(self.model, sorted(",
             "        self.repacked = [] and repack_modules(self.model, sorted("),),
           ("tests/integrations/test_vllm_api.py", "-k", "tied")),
    # ---------------------------------------------------------------- recipes
    Mutant("R1", "vLLM: q_norm and k_norm storages swapped",
           "ray_reshard/engines/vllm/layout.py",
           (('                put("q_norm", A + "q_norm.weight", hd)\n'
             '                put("k_norm", A + "k_norm.weight", hd)\n',
             '                put("q_norm", A + "k_norm.weight", hd)\n'
             '                put("k_norm", A + "q_norm.weight", hd)\n'),),
           tuple(RECIPES)),
    Mutant("R2", "vLLM: input and post-attention norms swapped",
           "ray_reshard/engines/vllm/layout.py",
           (('        put("in_norm", P + "input_layernorm.weight", H)\n',
             '        put("in_norm", P + "post_attention_layernorm.weight", H)\n'),
            ('        put("post_norm", P + "post_attention_layernorm.weight", H)\n',
             '        put("post_norm", P + "input_layernorm.weight", H)\n')),
           tuple(RECIPES)),
    Mutant("R3", "Megatron MLA: linear_q_down_proj and linear_kv_down_proj swapped",
           "ray_reshard/engines/megatron/layout.py",
           (('A + "linear_q_down_proj.weight"', 'A + "linear_kv_down_proj.TMP"'),
            ('A + "linear_kv_down_proj.weight"', 'A + "linear_q_down_proj.weight"'),
            ('A + "linear_kv_down_proj.TMP"', 'A + "linear_kv_down_proj.weight"')),
           tuple(RECIPES)),
    Mutant("R4", "Megatron: shared experts' gate and up halves swapped in linear_fc1",
           "ray_reshard/engines/megatron/layout.py",
           (('            off = 0 if k.endswith("gate") else size // par.tp',
             '            off = 0 if k.endswith("up" if shared else "gate") else size // par.tp'),),
           tuple(RECIPES)),
    Mutant("R5", "Megatron: expert ranks ordered ep-major instead of etp, ep, edp",
           "ray_reshard/engines/megatron/layout.py",
           (("(s + 1) * p.stage_size).reshape(\n                p.expert_dp, p.ep, p.expert_tp)",
             "(s + 1) * p.stage_size).reshape(\n                p.ep, p.expert_dp, p.expert_tp)"
             ".transpose(1, 0, 2)"),),
           tuple(RECIPES)),
    Mutant("R6", "vLLM: round-robin expert placement taken as linear",
           "ray_reshard/engines/vllm/layout.py",
           (("        return list(range(ep_rank, n_experts, self.ep))",
             "        return list(range(ep_rank * base, ep_rank * base + n))"),),
           tuple(RECIPES)),
    Mutant("R7", "vLLM: kv heads replicated over the wrong ranks when tp > kv heads",
           "ray_reshard/engines/vllm/layout.py",
           (("grid.reshape(grid.shape[0], nkv, r)",
             "grid.reshape(grid.shape[0], r, nkv).transpose(0, 2, 1)"),),
           tuple(RECIPES)),
    Mutant("R8", "vLLM MLA: q_a and kv_a swapped inside fused_qkv_a_proj",
           "ray_reshard/engines/vllm/layout.py",
           (('Slot(n("q_a"), dim=0, offset=0)',
             'Slot(n("q_a"), dim=0, offset=d.kv_lora_rank + d.qk_rope_dim)'),
            ('Slot(n("q_a"), dim=0, offset=d.q_lora_rank)', 'Slot(n("q_a"), dim=0, offset=0)')),
           tuple(RECIPES)),
    Mutant("R9", "vLLM FP8: o_proj kept in the model dtype",
           "ray_reshard/engines/vllm/layout.py",
           (('FP8_ROLES = frozenset({"qkv_w", "o_w", ', 'FP8_ROLES = frozenset({"qkv_w", '),
            ('FP8_KINDS = frozenset({"q", "k", "v", "o", ', 'FP8_KINDS = frozenset({"q", "k", "v", ')),
           ("tests/models/test_fp8_refit.py", "-k", "simulated")),
]


def export_commit(dst: str, rev: str = "HEAD") -> None:
    """The repository at commit `rev`, written to `dst` (git archive: the repository itself
    is only read)."""
    os.makedirs(dst)
    archive = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", rev],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dst], input=archive, check=True)


def copy_tree(dst: str) -> None:
    """The repository's tracked and untracked (not ignored) files as they are now, copied to
    `dst`."""
    files = subprocess.run(["git", "-C", REPO, "ls-files", "-z", "-c", "-o", "--exclude-standard"],
                           check=True, capture_output=True).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        rel = f.decode()
        src = os.path.join(REPO, rel)
        if not os.path.isfile(src):
            continue
        out = os.path.join(dst, rel)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        shutil.copy2(src, out)


def apply(text: str, m: Mutant) -> str:
    for old, new in m.edits:
        n = text.count(old)
        if n != 1:
            raise LookupError(f"{m.id}: {old[:60]!r} occurs {n} times in {m.path}")
        text = text.replace(old, new)
    return text


def run_mutant(tree: str, m: Mutant, python: str, timeout_s: float, show: bool = False
               ) -> tuple[str, float, str]:
    """(outcome, seconds, last line of pytest's output)."""
    path = os.path.join(tree, m.path)
    with open(path) as f:
        original = f.read()
    try:
        mutated = apply(original, m)
    except LookupError as e:
        return "stale", 0.0, str(e)
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONDONTWRITEBYTECODE="1")
    env.pop("CI", None)
    t0 = time.monotonic()
    try:
        with open(path, "w") as f:
            f.write(mutated)
        try:
            p = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                *m.tests], cwd=tree, env=env, capture_output=True, text=True,
                               timeout=timeout_s)
            code, out = p.returncode, (p.stdout + p.stderr).strip().splitlines()
        except subprocess.TimeoutExpired:
            code, out = None, ["timed out"]
    finally:
        with open(path, "w") as f:
            f.write(original)
    outcome = {0: "survived", 1: "killed"}.get(code, f"error ({code})")
    # the test that failed (pytest -q's summary), else the last line
    last = next((line for line in out if line.startswith(("FAILED tests/", "ERROR tests/"))),
                next((line for line in reversed(out) if line.strip()), ""))
    if show:
        print("\n".join(line for line in out if line.startswith("E ")))
    return outcome, time.monotonic() - t0, last


def check_import_path(tree: str, python: str) -> None:
    """The copy, not the working tree, is what the tests import."""
    env = dict(os.environ, PYTHONPATH=tree)
    where = subprocess.run([python, "-c", "import ray_reshard; print(ray_reshard.__file__)"],
                           cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    if not os.path.realpath(where.strip()).startswith(os.path.realpath(tree)):
        raise SystemExit(f"ray_reshard imports from {where.strip()}, not from the copy {tree}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="mutant ids to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--python", default=os.path.join(REPO, ".venv", "bin", "python"))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant")
    ap.add_argument("--show", action="store_true", help="print the failing assertions")
    ap.add_argument("--commit", default="HEAD",
                    help="the commit to mutate (e.g. an older one, to compare test suites)")
    ap.add_argument("--working-tree", action="store_true",
                    help="mutate the files as they are now instead of the last commit")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.id in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.id}  {m.what}  [{m.path}]  tests: {' '.join(m.tests)}")
        return 0
    with tempfile.TemporaryDirectory(prefix="rr-mutants-") as tmp:
        tree = os.path.join(tmp, "tree")
        if args.working_tree:
            copy_tree(tree)
        else:
            export_commit(tree, args.commit)
        check_import_path(tree, args.python)
        rows = []
        for m in chosen:
            outcome, secs, last = run_mutant(tree, m, args.python, args.timeout, args.show)
            rows.append((m, outcome, secs, last))
            print(f"{m.id:3} {outcome:9} {secs:6.1f} s  {m.what}\n      {last}", flush=True)
    killed = sum(1 for _, o, _, _ in rows if o == "killed")
    print("\n| mutant | area | decision flipped | outcome | first failing test |\n"
          "|---|---|---|---|---|")
    for m, outcome, _, last in rows:
        first = last.split(" ")[1] if last.startswith(("FAILED tests/", "ERROR tests/")) else ""
        print(f"| {m.id} | {m.path.split('/')[1]} | {m.what} | {outcome} | {first} |")
    print(f"\nmutation score: {killed}/{len(rows)} killed")
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
