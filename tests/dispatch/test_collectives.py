"""What crosses ranks in one dispatch + combine (forward and backward): tokens, and one exchange of counts.

Every ``torch.distributed`` collective is recorded (name, per-row shape, dtype, bytes) while a
dispatcher moves tokens whose routing probs require gradients. The alltoall dispatcher must move
only token rows (``[*, H]`` in the tokens' dtype), their probs beside them (``[*]`` fp32, by the same
collective with the same splits as a token exchange: the experts apply them) plus ONE tiny all-gather
of the split sizes per layer (the etp x ep group's ``[E]`` counts), in every layout.
The allgather dispatcher moves exactly its raw pattern (one all-gather forward, one
reduce-scatter in combine, and their reverses in backward) plus the count header.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from moefold.dispatch import DispatchConfig, DispatcherKind, build_dispatcher
from moefold.parallel import ParallelConfig, ParallelDims
from tests.dispatch.common import H, expert_weights, make_case, make_routing, run_experts
from tests.distributed import run_distributed

E = 8
TOKENS = [6, 5, 7, 4]
_COLLECTIVES = ("all_to_all_single", "all_to_all", "all_gather_into_tensor", "all_gather_single", "all_gather",
                "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter", "all_reduce", "broadcast", "send",
                "recv", "isend", "irecv")


@contextlib.contextmanager
def recorded_collectives() -> Iterator[list[tuple[str, tuple[int, ...], torch.dtype, int]]]:
    """Record (name, shape of the sent tensor, dtype, bytes sent) of every collective called inside."""
    calls: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        def recorder(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            sent = tensors[1] if name in ("all_to_all_single", "all_gather_into_tensor", "all_gather_single",
                                          "reduce_scatter_tensor", "reduce_scatter_single") else tensors[0]
            calls.append((name, tuple(sent.shape), sent.dtype, sent.numel() * sent.element_size()))
            return fn(*args, **kwargs)
        return recorder

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _one_layer(d, dims, mode: str):
    rank = dims.rank
    off = sum(TOKENS[:rank])
    x_all, ids_all, probs_all = make_case("random", TOKENS, E)
    sl = slice(off, off + TOKENS[rank])
    r = make_routing(probs_all[sl], ids_all[sl], E, mode, capacity=3)
    probs = r.probs_TK.clone().requires_grad_()
    routing = type(r)(probs, r.expert_ids_TK, r.tokens_per_expert_E, r.keep_TK, r.capacity, r.pad_to_capacity)
    x = x_all[sl].clone().requires_grad_()
    w1, w2 = expert_weights(E)
    with recorded_collectives() as calls:
        out = d.dispatch(x, routing)
        per = out.tokens_per_expert_e.tolist()
        y = d.combine(run_experts(out.tokens_NH, per, d.local_expert_offset, w1, w2, d.etp, dims.etp_rank,
                                  probs_N=out.probs_N), out.handle)
        y.square().sum().backward()
    assert probs.grad is not None and probs.grad.abs().sum() > 0 and x.grad is not None
    return calls


def _world(layouts):
    failures = []
    for ep, etp, chunks in layouts:
        dims = ParallelDims.build(ParallelConfig(ep=ep, etp=etp))
        for mode in ("dropless", "drop", "padded"):
            tag = f"alltoall ep{ep} etp{etp} max_chunked_experts={chunks} {mode}"
            d = build_dispatcher(DispatchConfig(DispatcherKind.ALLTOALL, max_chunked_experts=chunks), E, dims)
            calls = _one_layer(d, dims, mode)
            rows = [c for c in calls if c[1][1:] == (H,) and c[2] == torch.float32]
            probs = [c for c in calls if len(c[1]) == 1 and c[2] == torch.float32]
            other = [c for c in calls if c not in rows and c not in probs]
            counts = [c for c in other if c[0] in ("all_gather_into_tensor", "all_gather_single")
                      and c[2] == torch.int64 and c[1] == (E,)]
            want_counts = 0 if mode == "padded" else 1
            if len(counts) != want_counts or len(other) != want_counts:
                failures.append(f"{tag}: besides token rows and probs {other}; expected {want_counts} count "
                                f"all-gather of [{E}] int64 and nothing else")
            # each probs exchange rides a token exchange of the same rows (same collective, same row count)
            unmatched = [c for c in rows]
            for name, (n,), _, _ in probs:
                match = next((c for c in unmatched if c[0] == name and c[1][0] == n), None)
                if match is None:
                    failures.append(f"{tag}: a probs {name} of {n} rows without a token exchange of the same rows")
                else:
                    unmatched.remove(match)
            if dims.ep * dims.etp > 1 and not probs:
                failures.append(f"{tag}: the probs did not travel with the rows")
            if not rows:
                failures.append(f"{tag}: no token exchange recorded")
        # allgather: the raw pattern plus the header
        for mode in ("dropless", "padded"):
            tag = f"allgather ep{ep} etp{etp} {mode}"
            calls = _one_layer(build_dispatcher(DispatchConfig(DispatcherKind.ALLGATHER), E, dims), dims, mode)
            names = [c[0] for c in calls]
            header = [c for c in calls if c[2] == torch.int64 and c[1] == (E + 2,)]
            gathers = [n for n in names if n in ("all_gather_into_tensor", "all_gather_single")]
            scatters = [n for n in names if n in ("reduce_scatter_tensor", "reduce_scatter_single")]
            # forward: header + one packed gather; combine: one reduce-scatter; backward: the combine's
            # gather and ONE reduce-scatter of the token and prob gradients together (fp32)
            if len(header) != 1 or len(gathers) != 3 or len(scatters) != 2 or len(calls) != 5:
                failures.append(f"{tag}: collectives {[(c[0], c[1], c[2]) for c in calls]}")
    return failures


def test_only_tokens_and_one_count_exchange_cross_ranks():
    layouts = [(4, 1, 8), (4, 1, 0), (2, 2, 8), (1, 4, 8)]  # chunked, one exchange + sort, etp, etp only
    results = run_distributed(_world, 4, layouts, timeout=300)
    failures = sorted({f for per_rank in results for f in per_rank})
    assert not failures, "\n".join(failures)
