import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """These tests use tiny tensors: intra-op threads only add wake-up latency (ms per op on a busy
    host), so run them on one thread and give the setting back afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
