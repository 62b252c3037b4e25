import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The models here are tiny: intra-op threads only add contention on small machines."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
