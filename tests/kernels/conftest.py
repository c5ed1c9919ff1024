import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny shapes: OpenMP fork/join costs more than it saves, worse on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
