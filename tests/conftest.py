import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


os.environ.setdefault("RAY_DEDUP_LOGS", "0")

# Under CI (CI=true) only tests marked `gpu` may skip: a test skipped for anything else (a
# missing compiler, vLLM, a package) hides work, so the run fails and names it.
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
_skipped_in_ci: list = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail") and \
            item.get_closest_marker("gpu") is None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped_in_ci.append(f"{item.nodeid}: {reason}")
        report.outcome = "failed"
        report.longrepr = (f"skipped under CI=true ({reason}); only tests marked gpu may skip "
                           f"in CI: install what this test needs")


def pytest_collectreport(report):
    """A whole module skipped at import (pytest.importorskip at the top) counts too."""
    if IN_CI and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped_in_ci.append(f"{report.nodeid}: {reason}")
        report.outcome = "failed"


@pytest.fixture(scope="module")
def cluster():
    """The session's shared two-node cluster (see ray_reshard.tools.testing.start_cluster), connected
    for this module; leaving the module ends its job and the actors it made."""
    import ray

    from ray_reshard.tools.testing import start_cluster

    c = start_cluster(2)
    yield c
    c.shutdown()
    if ray.is_initialized():
        ray.shutdown()


def pytest_sessionfinish(session, exitstatus):
    from ray_reshard.tools.testing import shutdown_shared

    shutdown_shared()
    if _skipped_in_ci:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _skipped_in_ci:
        terminalreporter.section("skips turned into failures (CI=true)")
        for line in _skipped_in_ci:
            terminalreporter.write_line(line)
