"""The multi-rank harness itself: results come back in rank order, failures and hangs surface."""

import time

import pytest
import torch.distributed as dist

from tests.distributed import RankFailure, run_distributed


def _rank_times(x: int) -> int:
    return dist.get_rank() * x


def _rank_two_fails() -> None:
    if dist.get_rank() == 2:
        raise ValueError("rank two is broken on purpose")
    dist.barrier()  # the other ranks wait for a rank that never arrives


def _rank_one_hangs() -> None:
    if dist.get_rank() == 1:
        time.sleep(600)


def test_results_in_rank_order():
    assert run_distributed(_rank_times, 4, 10) == [0, 10, 20, 30]


def test_failing_rank_reraises_its_traceback():
    with pytest.raises(RankFailure) as err:
        run_distributed(_rank_two_fails, 4, timeout=60)
    assert "rank 2 of 4 failed" in str(err.value)
    assert "ValueError: rank two is broken on purpose" in str(err.value)
    assert "_rank_two_fails" in str(err.value)  # the traceback, not just the message


def test_hanging_rank_is_killed_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 did not finish within 3s"):
        run_distributed(_rank_one_hangs, 2, timeout=3)
    assert time.monotonic() - start < 30
