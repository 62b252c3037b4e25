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


@pytest.fixture(scope="module")
def cluster():
    """The session's shared two-node cluster (see ray_reshard.testing.start_cluster), connected
    for this module; leaving the module ends its job and the actors it made."""
    import ray

    from ray_reshard.testing import start_cluster

    c = start_cluster(2)
    yield c
    c.shutdown()
    if ray.is_initialized():
        ray.shutdown()


def pytest_sessionfinish(session, exitstatus):
    from ray_reshard.testing import shutdown_shared

    shutdown_shared()
