import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def pytest_sessionfinish(session, exitstatus):
    from ray_reshard.testing import shutdown_shared

    shutdown_shared()
