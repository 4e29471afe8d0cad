"""``--moe-router-padding-for-quantization``: the dispatch lays every (source rank, expert) chunk out padded to the
multiple with zero rows, inside the row map (the permute writes them, the combine drops them: no padded copy).

In one 4-rank world, allgather and alltoall (chunked and sorted) at ep 1/2/4 and etp 2, the local dispatcher:
every expert's token count is a multiple of the padding, every added row is zero, and combine(experts(dispatch))
equals the unpadded reference, values and gradients (rank 1 has no tokens at all).
"""

import dataclasses

import torch

from moefold.dispatch import DispatchConfig, DispatcherKind, build_dispatcher
from moefold.dispatch.permutation import build_padded_row_map, mask_groups, permute, unpermute
from moefold.parallel import ParallelConfig, ParallelDims
from tests.dispatch.common import combine_and_compare, expert_weights, make_case, make_routing, reference
from tests.distributed import run_distributed

E, PAD = 8, 4
TOKENS = [5, 0, 7, 3]


def test_padded_row_map_writes_zero_rows_and_drops_them():
    ids = torch.tensor([[0, 2], [2, 3], [0, 2]])
    key = mask_groups(ids, 4)
    row_map = build_padded_row_map(key, 3, 2, 4, [2, 0, 3, 1], PAD)
    assert row_map.counts_G.tolist() == [4, 0, 4, 4] and row_map.num_rows == 12
    x = torch.randn(3, 5, requires_grad=True)
    rows = permute(x, row_map)
    real = row_map.slot_of_row_N < 6
    assert real.sum() == 6 and not rows[~real].any()
    y = unpermute(rows, row_map)
    torch.testing.assert_close(y, 2 * x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def _check(layouts):
    rank = torch.distributed.get_rank()
    off = sum(TOKENS[:rank])
    mine = slice(off, off + TOKENS[rank])
    w1, w2 = expert_weights(E)
    failures = []
    for ep, etp in layouts:
        dims = ParallelDims.build(ParallelConfig(ep=ep, etp=etp))
        kinds = ["allgather", "alltoall"] + (["alltoall_sorted"] if etp == 1 and ep > 1 else [])
        kinds += ["local"] if ep * etp == 1 else []
        for kind in kinds:
            d = (build_dispatcher(DispatchConfig(DispatcherKind.ALLTOALL, max_chunked_experts=0), E, dims)
                 if kind == "alltoall_sorted"
                 else build_dispatcher(DispatchConfig(kind), E, dims))
            for case in ("random", "one_expert", "topk_all"):
                x, ids, probs = make_case(case, TOKENS, E)
                g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
                xr, pr = x.clone().requires_grad_(), probs.clone().requires_grad_()
                (reference(xr, pr, ids, None, w1, w2) * g).sum().backward()
                y_ref = reference(x, probs, ids, None, w1, w2)
                x_l, p_l = x[mine].clone().requires_grad_(), probs[mine].clone().requires_grad_()
                r = make_routing(probs[mine], ids[mine], E, "dropless", None)
                routing = dataclasses.replace(r, probs_TK=p_l, pad_multiple=PAD)
                out = d.dispatch_start(x_l, routing).wait()
                per = out.tokens_per_expert_e.tolist()
                tag = f"{kind} ep{ep} etp{etp} {case}"
                if any(c % PAD for c in per) or sum(per) != out.tokens_NH.shape[0] or (
                        out.tokens_per_expert_host is not None and list(out.tokens_per_expert_host) != per):
                    failures.append(f"{tag}: counts {per} (host {out.tokens_per_expert_host})")
                    continue
                want = {"y": y_ref[mine], "grad x": xr.grad[mine], "grad probs": pr.grad[mine]}
                combine_and_compare(d, out, w1, w2, etp, dims.etp_rank, g[mine], x_l, p_l, want, tag, failures)
    return failures


def test_router_padding_roundtrip_all_layouts():
    results = run_distributed(_check, 4, [(1, 1), (2, 1), (4, 1), (2, 2)], timeout=300)
    failures = sorted({f for per_rank in results for f in per_rank})
    assert not failures, "\n".join(failures)
