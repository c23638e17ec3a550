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
