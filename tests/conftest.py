"""Fixtures shared by the tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """For test modules that run tiny models in this process (training steps, the bf16 accuracy draws): a second
    intra-op thread only adds contention (on a shared 2-core machine, 10x slower steps; the gated delta rule's
    small batched triangular solves 10-300x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's per-test limit (pyproject's ``timeout``, a hang detector) stretched by the load when the
    test starts (tests/load.py): a test that passes alone must not time out on a loaded machine (issue 48)."""
    import pytest_timeout

    from tests.load import scaled

    return pytest_timeout.pytest_timeout_set_timer(item, settings._replace(timeout=scaled(settings.timeout)))
