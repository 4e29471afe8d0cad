"""Fixtures shared by the training tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """For test modules that train tiny models in this process: a second intra-op thread only adds contention (on a
    shared 2-core machine, 10x slower steps)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
