"""A chunked uneven all-to-all that lands rows directly in expert-major order (no sort pass).

The plain exchange receives [source rank x local expert] chunks and must then regroup them
(``sort_chunks``: a full copy of the rows, and another one on the way back). Instead, the sender
orders its rows [local expert index j x destination rank], and one all-to-all per j moves block
j: it arrives ordered by source rank, i.e. exactly as local expert j's rows in expert-major
order, written straight into their slice of the output. e collectives instead of one, no copy.
The collectives are ``dispatch.token_exchange.AllToAllExchange``'s chunks; these functions add autograd
(backward: the same exchange with the splits swapped).
"""

from __future__ import annotations

from torch import Tensor

from moefold.dispatch.token_exchange import AllToAllExchange, InFlight, exchange_with_grad
from moefold.parallel.groups import Group


def chunked_all_to_all_async(x: Tensor, out_splits: list[list[int]], in_splits: list[list[int]],
                             group: Group) -> InFlight[Tensor]:
    """For each chunk c, all-to-all of the next sum(in_splits[c]) rows (rank r's share ``in_splits[c][r]``),
    received rows appended in chunk order (``out_splits[c][r]`` from rank r); ``.wait()`` for the rows."""
    exchange = AllToAllExchange(tuple(map(tuple, in_splits)), tuple(map(tuple, out_splits)), group)
    flight = exchange_with_grad(exchange, x)
    return InFlight(lambda: flight.wait()[1][0])


def chunked_all_to_all(x: Tensor, out_splits: list[list[int]], in_splits: list[list[int]], group: Group) -> Tensor:
    """Synchronous ``chunked_all_to_all_async``."""
    return chunked_all_to_all_async(x, out_splits, in_splits, group).wait()
