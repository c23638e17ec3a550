import os

import pytest
import torch

# Tests never need more than the machine's two cores; pin it so timing noise stays low.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny tensors
    and elementwise-heavy references only add contention with threads on a shared CI machine (measured 2-8x)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
