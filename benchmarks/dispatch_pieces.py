"""Split the all-to-all dispatcher's dispatch + combine into its pieces, on 4 spawned gloo ranks.

    python -m benchmarks.dispatch_pieces --iters 20     # from the repository root (it uses tests.distributed)

Every variant runs after a barrier, interleaved with the others in the same world (so load
drift hits all alike); the slowest rank's time per iteration is kept and the median printed:

- raw_pre / raw_alloc: two ``all_to_all_single`` with the dispatch's split sizes, receive buffers
  preallocated / allocated per call
- chunked: the dispatcher's chunked exchange alone (one all-to-all per local expert, both ways)
- counts: the count all-gather and its ``.tolist()`` host sync
- local: permute + unpermute (argsort, row map, gather, the per-token sum), no communication
- e2e: dispatch + combine (rows passed straight back; the probs travel with them, the combine sums)
- overlap: the raw exchange launched asynchronously while permuting, then unpermute under the
  return exchange (does overlapping local work with gloo's exchange pay on this machine?)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from tests.distributed import run_distributed

T, H, E, K, EP = 4096, 512, 16, 2, 4


def _rank(iters: int) -> dict[str, float]:
    torch.set_num_threads(1)
    from moefold.dispatch import DispatchConfig, DispatcherKind, build_dispatcher
    from moefold.dispatch.alltoall import gather_counts
    from moefold.dispatch.permutation import build_row_map, count_keys, mask_groups, permute, unpermute
    from moefold.dispatch.token_exchange import AllToAllExchange, exchange_with_grad
    from moefold.parallel import ParallelConfig, ParallelDims
    from moefold.tools.bench_dispatch import _route

    dims = ParallelDims.build(ParallelConfig(ep=EP))
    g = dims.ep_group
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(dims.rank))
    w_gate = torch.randn(H, E, generator=torch.Generator().manual_seed(0)) / H ** 0.5
    disp = build_dispatcher(DispatchConfig(DispatcherKind.ALLTOALL), E, dims)
    routing = _route(x, w_gate, torch.zeros(E), K)
    h = disp.dispatch(x, routing).handle
    send, recv = list(h.plan.send), list(h.plan.recv)
    rows = torch.randn(sum(send), H)
    pre_out, pre_back = torch.empty(sum(recv), H), torch.empty(sum(send), H)

    def row_map():
        return build_row_map(disp._send_key(mask_groups(routing.expert_ids_TK, E)), T, K, E, num_rows=T * K)

    def raw_pre():
        dist.all_to_all_single(pre_out, rows, recv, send, group=g)
        dist.all_to_all_single(pre_back, pre_out, send, recv, group=g)

    def raw_alloc():
        out = torch.empty(sum(recv), H)
        dist.all_to_all_single(out, rows, recv, send, group=g)
        dist.all_to_all_single(torch.empty(sum(send), H), out, send, recv, group=g)

    def chunked_exchange(x, out_splits, in_splits):
        """One all-to-all per local expert (chunk c: rank r sends ``in_splits[c][r]`` rows, receives
        ``out_splits[c][r]``), the rows landing in expert-major order, with autograd: the dispatcher's exchange."""
        exchange = AllToAllExchange(tuple(map(tuple, in_splits)), tuple(map(tuple, out_splits)), g)
        return exchange_with_grad(exchange, x).wait()[1][0]

    def chunked():
        got = chunked_exchange(rows, h.plan.chunk_recv, h.plan.chunk_send)
        chunked_exchange(got, h.plan.chunk_send, h.plan.chunk_recv)

    def counts():
        gather_counts(count_keys(routing.expert_ids_TK.reshape(-1), E), g).tolist()

    def local():
        rm = row_map()
        unpermute(permute(x, rm), rm)

    def e2e():
        d = disp.dispatch(x, routing)
        disp.combine(d.tokens_NH, d.handle)

    def overlap():
        out = torch.empty(sum(recv), H)
        work = dist.all_to_all_single(out, rows, recv, send, group=g, async_op=True)
        rm = row_map()
        permuted = permute(x, rm)
        work.wait()
        work = dist.all_to_all_single(torch.empty(sum(send), H), out, send, recv, group=g, async_op=True)
        unpermute(permuted, rm)
        work.wait()

    variants = {f.__name__: f for f in (raw_pre, raw_alloc, chunked, counts, local, e2e, overlap)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(iters + 2):
        for name, fn in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i >= 2:
                times[name].append(t.item())
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    from moefold.training.observe.machine import describe_machine

    print(describe_machine())
    print(f"# {EP} gloo ranks x 1 torch thread, T={T} H={H} E={E} k={K} fp32, load average at start "
          f"{os.getloadavg()[0]:.1f}")
    result = run_distributed(_rank, EP, a.iters, timeout=600)[0]
    print("  ".join(f"{k} {v:.2f} ms" for k, v in result.items()))
    print(f"# load average at end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
