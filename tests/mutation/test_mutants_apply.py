"""Every mutant of the mutation pass still applies to the code as it is (its text occurs exactly
once in its file) and names tests that exist: a refactor must carry the mutants along."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from run_mutations import MUTANTS, REPO, apply  # noqa: E402


def test_every_mutant_applies_and_its_tests_exist():
    stale = []
    for m in MUTANTS:
        with open(os.path.join(REPO, m.path)) as f:
            text = f.read()
        try:
            apply(text, m)
        except LookupError as e:
            stale.append(str(e))
        for arg in m.tests:
            if arg.startswith("tests/") and not os.path.exists(os.path.join(REPO, arg.split("::")[0])):
                stale.append(f"{m.id}: no test file {arg}")
    assert not stale, "\n".join(stale)
    assert len({m.id for m in MUTANTS}) == len(MUTANTS)
