"""Every autograd collective, forward and backward, on 2 and 4 ranks against single-process math.

Each rank can generate every rank's tensors (seeded by rank), so the expected value is
computed locally with plain torch and compared with what the collective produced.
"""

import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moefold.parallel import (
    all_gather_sequence,
    all_reduce_sum,
    all_to_all,
    all_to_all_async,
    copy_to_region,
    gather_along_dim,
    reduce_from_region,
    reduce_scatter_sequence,
    scatter_along_dim,
)
from tests.distributed import run_distributed


def _t(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _grad(fn, x: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    y = fn(x)
    (y * upstream).sum().backward()
    return y.detach(), x.grad


def _check_all(split_matrix: list[list[int]]) -> None:
    # a deprecated collective (all_gather_into_tensor / reduce_scatter_tensor warn on torch >= 2.13) fails here
    warnings.simplefilter("error", FutureWarning)
    group, n, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    ranks = range(n)

    # copy-to-region: identity forward, gradient summed over ranks
    y, gx = _grad(lambda x: copy_to_region(x, group), _t(0, 3, 4), _t(100 + r, 3, 4))
    torch.testing.assert_close(y, _t(0, 3, 4), rtol=0, atol=0)
    torch.testing.assert_close(gx, sum(_t(100 + i, 3, 4) for i in ranks))

    # plain sum for statistics: a new tensor outside autograd, the input untouched
    x = _t(60 + r, 3, 4).requires_grad_(True)
    y = all_reduce_sum(x, group)
    torch.testing.assert_close(y, sum(_t(60 + i, 3, 4) for i in ranks))
    assert not y.requires_grad and torch.equal(x.detach(), _t(60 + r, 3, 4))

    # reduce-from-region: sum forward, identity backward
    y, gx = _grad(lambda x: reduce_from_region(x, group), _t(10 + r, 3, 4), _t(200 + r, 3, 4))
    torch.testing.assert_close(y, sum(_t(10 + i, 3, 4) for i in ranks))
    torch.testing.assert_close(gx, _t(200 + r, 3, 4), rtol=0, atol=0)

    for dim in (0, 1, -1):
        full_shape = [2 * n, 3 * n, 4 * n]
        chunk_shape = list(full_shape)
        chunk_shape[dim] //= n
        # scatter: keep own chunk; backward all-gathers the chunks' gradients
        y, gx = _grad(lambda x: scatter_along_dim(x, group, dim), _t(1, *full_shape), _t(300 + r, *chunk_shape))
        torch.testing.assert_close(y, _t(1, *full_shape).chunk(n, dim)[r])
        torch.testing.assert_close(gx, torch.cat([_t(300 + i, *chunk_shape) for i in ranks], dim))

        # gather: concatenate; backward keeps own chunk of the (replicated) gradient
        y, gx = _grad(lambda x: gather_along_dim(x, group, dim), _t(20 + r, *chunk_shape), _t(2, *full_shape))
        torch.testing.assert_close(y, torch.cat([_t(20 + i, *chunk_shape) for i in ranks], dim))
        torch.testing.assert_close(gx, _t(2, *full_shape).chunk(n, dim)[r])

        # sequence-parallel all-gather: backward reduce-scatters the per-rank gradients
        y, gx = _grad(lambda x: all_gather_sequence(x, group, dim), _t(30 + r, *chunk_shape),
                      _t(400 + r, *full_shape))
        torch.testing.assert_close(y, torch.cat([_t(30 + i, *chunk_shape) for i in ranks], dim))
        torch.testing.assert_close(gx, sum(_t(400 + i, *full_shape) for i in ranks).chunk(n, dim)[r])

        # sequence-parallel reduce-scatter: backward all-gathers
        y, gx = _grad(lambda x: reduce_scatter_sequence(x, group, dim), _t(40 + r, *full_shape),
                      _t(500 + r, *chunk_shape))
        torch.testing.assert_close(y, sum(_t(40 + i, *full_shape) for i in ranks).chunk(n, dim)[r])
        torch.testing.assert_close(gx, torch.cat([_t(500 + i, *chunk_shape) for i in ranks], dim))

    # uneven all-to-all: split_matrix[i][j] rows go from rank i to rank j (zeros included)
    send = [split_matrix[r][j] for j in ranks]
    recv = [split_matrix[i][r] for i in ranks]
    x_of = [_t(50 + i, sum(split_matrix[i]), 5) for i in ranks]
    g_of = [_t(600 + j, sum(split_matrix[i][j] for i in ranks), 5) for j in ranks]
    expected = torch.cat([x_of[i].split(split_matrix[i])[r] for i in ranks])
    expected_grad = torch.cat([g_of[j].split([split_matrix[i][j] for i in ranks])[r] for j in ranks])
    for launch in (lambda x: all_to_all(x, recv, send, group),
                   lambda x: all_to_all_async(x, recv, send, group).wait()):
        y, gx = _grad(launch, x_of[r], g_of[r])
        torch.testing.assert_close(y, expected, rtol=0, atol=0)
        torch.testing.assert_close(gx, expected_grad, rtol=0, atol=0)


SPLITS = {
    2: [[3, 0], [1, 2]],
    4: [[1, 0, 2, 3], [0, 0, 0, 0], [2, 1, 0, 4], [0, 3, 1, 0]],  # rank 1 sends nothing
}


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_single_process_math(world):
    run_distributed(_check_all, world, SPLITS[world])


def test_size_one_group_is_a_no_op():
    x = _t(0, 4, 6).requires_grad_(True)
    for fn in (copy_to_region, reduce_from_region, scatter_along_dim, gather_along_dim,
               all_gather_sequence, reduce_scatter_sequence):
        assert fn(x, None) is x
    assert all_to_all(x, [4], [4], None) is x
    assert all_reduce_sum(x, None) is x
    assert all_to_all_async(x, [4], [4], None).wait() is x


def test_all_to_all_rejects_splits_that_do_not_match():
    with pytest.raises(ValueError, match=r"input_splits=\[3\] sum to 3 but the input has 4 rows"):
        all_to_all(torch.zeros(4, 2), [3], [3], None)
    with pytest.raises(ValueError, match="needs 1 splits per direction"):
        all_to_all(torch.zeros(4, 2), [2, 2], [2, 2], None)


def test_no_deprecated_collective_is_called():
    """torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
    reduce_scatter_single; the old names print a FutureWarning per call on every rank. Only parallel/comm.py
    names them (its fallback for torch < 2.13): every other module calls comm's wrappers."""
    root = Path(__file__).resolve().parents[2]
    old = re.compile(r"\bdist\.(all_gather_into_tensor|reduce_scatter_tensor|_all_gather_base|_reduce_scatter_base)\(")
    callers = [f"{path.relative_to(root)}:{n}" for path in sorted(root.glob("*/**/*.py"))
               if path.parts[len(root.parts)] not in ("tests", "build", ".git") and "site-packages" not in path.parts
               for n, line in enumerate(path.read_text().splitlines(), 1) if old.search(line)]
    assert not callers, f"deprecated collectives called at {callers}: use moefold.parallel.comm's wrappers"
