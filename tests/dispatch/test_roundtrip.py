"""combine(experts(dispatch(x))) on 8 gloo ranks equals the single-process reference, values and grads.

One world of 8 ranks runs every layout: dispatcher in {allgather, alltoall} x ep in {1, 2, 4} x
etp in {1, 2} (edp fills the rest), routing modes dropless / drop (keep mask) / padded, and the
cases random (with an expert that gets no tokens), all tokens to one expert and top-k = E. Rank 1
has no tokens at all. The experts are a per-expert tanh MLP whose FFN dim is split over etp, so
combine must add the etp partial sums.
"""

import torch

from moefold.dispatch import DispatchConfig, DispatcherKind, build_dispatcher
from moefold.parallel import ParallelConfig, ParallelDims
from tests.dispatch.common import combine_and_compare, expert_weights, make_case, make_routing, reference
from tests.distributed import own_groups, run_distributed

E = 8
TOKENS = [5, 0, 7, 3, 6, 2, 4, 8]  # per rank; rank 1 has none
CAPACITY = 2


def _check_all(layouts):
    rank = torch.distributed.get_rank()
    off = sum(TOKENS[:rank])
    mine = slice(off, off + TOKENS[rank])
    w1, w2 = expert_weights(E)
    failures = []
    for ep, etp in layouts:
        with own_groups():   # this layout's groups, closed before the next one's
            dims = ParallelDims.build(ParallelConfig(ep=ep, etp=etp))
            kinds = ["allgather", "alltoall"] + (["alltoall_sorted"] if etp == 1 and ep > 1 else [])
            for kind in kinds:
                # alltoall_sorted: one exchange + sort_chunks instead of the per-expert chunked exchange
                d = (build_dispatcher(DispatchConfig(DispatcherKind.ALLTOALL, max_chunked_experts=0), E, dims)
                     if kind == "alltoall_sorted"
                     else build_dispatcher(DispatchConfig(kind), E, dims))
                assert kind != "alltoall" or d.chunked == (etp == 1 and ep > 1)
                for case in ("random", "one_expert", "topk_all"):
                    for mode in ("dropless", "drop", "padded"):
                        x, ids, probs = make_case(case, TOKENS, E)
                        # capacity is per source rank: each rank's keep mask from its own tokens
                        routings = [make_routing(probs[sum(TOKENS[:r]):sum(TOKENS[:r + 1])], ids[sum(TOKENS[:r]):
                                                 sum(TOKENS[:r + 1])], E, mode, CAPACITY) for r in range(8)]
                        keep = None if mode == "dropless" else torch.cat([r.keep_TK for r in routings])
                        g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
                        xr = x.clone().requires_grad_()
                        pr = probs.clone().requires_grad_()
                        (reference(xr, pr, ids, keep, w1, w2) * g).sum().backward()
                        y_ref = reference(x, probs, ids, keep, w1, w2)

                        x_l = x[mine].clone().requires_grad_()
                        p_l = probs[mine].clone().requires_grad_()
                        r = routings[rank]
                        routing = type(r)(p_l, r.expert_ids_TK, r.tokens_per_expert_E, r.keep_TK, r.capacity,
                                          r.pad_to_capacity)
                        pending = d.dispatch_start(x_l, routing)
                        out = pending.wait()
                        per = out.tokens_per_expert_e.tolist()
                        tag = f"{kind} ep{ep} etp{etp} {case} {mode}"
                        if sum(per) != out.tokens_NH.shape[0]:
                            failures.append(f"{tag}: tokens_per_expert {per} vs {out.tokens_NH.shape[0]} rows")
                            continue
                        if mode == "padded" and per != [CAPACITY * ep * etp] * (E // ep):
                            failures.append(f"{tag}: padded tokens_per_expert {per}")
                        want = {"y": y_ref[mine], "grad x": xr.grad[mine], "grad probs": pr.grad[mine]}
                        combine_and_compare(d, out, w1, w2, etp, dims.etp_rank, g[mine], x_l, p_l, want, tag,
                                            failures)
    return failures


def test_roundtrip_all_layouts():
    layouts = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)]
    results = run_distributed(_check_all, 8, layouts, timeout=300)
    failures = sorted({f for per_rank in results for f in per_rank})
    assert not failures, "\n".join(failures)
