"""FP8 dispatch (``--moe-fp8-dispatch``, ``dispatch.fp8_exchange``):

- the row cast (e4m3, one scale per 128-channel block) stays within the e4m3 bound of each block's
  scale, and the packed bytes round-trip exactly;
- on 4 gloo ranks, for alltoall (chunked, sorted, ep2 x etp2), allgather and local: the dispatched
  tokens are exactly the e4m3 casts of the tokens the plain dispatcher delivers (hence within the e4m3
  bound), and combine(experts(dispatch(x))) equals the single-process reference evaluated at the cast
  tokens, with the gradients of the high-precision backward (the cast is straight-through);
- ``bench-dispatch --fp8`` reports the bytes and time of FP8 against the plain dispatch.
"""

from __future__ import annotations

import argparse

import torch

from moefold.dispatch import DispatchConfig, build_dispatcher
from moefold.dispatch.fp8_exchange import dequantize_rows, pack, quantize_rows, row_bytes, unpack
from moefold.parallel import ParallelConfig, ParallelDims
from moefold.tools import bench_dispatch
from moefold.training.cli import build_parser
from tests.dispatch.common import expert_weights, make_case, make_routing, reference, run_experts
from tests.distributed import run_distributed
from tests.fp8_reference import E4M3, cast_bound

E = 8
TOKENS = [5, 0, 7, 3]   # per rank; rank 1 has none


def _qdq(x: torch.Tensor) -> torch.Tensor:
    return dequantize_rows(*quantize_rows(x), x.dtype)


def test_row_cast_within_e4m3_bound_and_packing_is_exact():
    g = torch.Generator().manual_seed(0)
    for H, blocks in ((256, 2), (48, 1)):
        x = torch.randn(6, H, generator=g) * torch.logspace(-3, 2, H)   # the two 128-blocks differ in scale
        x[2] = 0.0                                                         # an all-zero row
        data, scale = quantize_rows(x)
        assert data.dtype == E4M3 and scale.shape == (6, blocks)
        inv = scale.repeat_interleave(H // blocks, dim=1)                  # the dequantisation multiplier
        err = (dequantize_rows(data, scale, torch.float32) - x).abs()
        assert (err <= cast_bound(x, inv, E4M3) * (1 + 1e-6)).all()
        assert torch.equal(dequantize_rows(data, scale, torch.float32)[2], torch.zeros(H))
        packed = pack(data, scale)
        assert packed.dtype == torch.uint8 and packed.shape == (6, row_bytes(H)) == (6, H + 4 * blocks)
        d2, s2 = unpack(packed, H)
        assert torch.equal(d2.view(torch.uint8), data.view(torch.uint8)) and torch.equal(s2, scale)
    assert row_bytes(7168) / (2 * 7168) < 0.52   # DeepSeek-V3's hidden: about half of bf16


def _check_all() -> list[str]:
    rank = torch.distributed.get_rank()
    off = sum(TOKENS[:rank])
    mine = slice(off, off + TOKENS[rank])
    w1, w2 = expert_weights(E)
    failures = []
    layouts = [("alltoall", 4, 1, {}), ("alltoall sorted", 4, 1, {"max_chunked_experts": 0}),
               ("alltoall", 2, 2, {}), ("allgather", 4, 1, {}), ("local", 1, 1, {})]
    for kind, ep, etp, opts in layouts:
        dims = ParallelDims.build(ParallelConfig(ep=ep, etp=etp))
        name = kind.split()[0]
        plain = build_dispatcher(DispatchConfig(name, **opts), E, dims)
        fp8 = build_dispatcher(DispatchConfig(name, fp8=True, **opts), E, dims)
        for mode in ("dropless", "drop"):
            tag = f"{kind} ep{ep} etp{etp} {mode}"
            x, ids, probs = make_case("random", TOKENS, E)
            routings = [make_routing(probs[sum(TOKENS[:r]):sum(TOKENS[:r + 1])],
                                     ids[sum(TOKENS[:r]):sum(TOKENS[:r + 1])], E, mode, 2) for r in range(4)]
            keep = None if mode == "dropless" else torch.cat([r.keep_TK for r in routings])
            g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
            # the reference at the cast tokens; its input gradient is what the straight-through cast passes on
            xq = _qdq(x).requires_grad_()
            pr = probs.clone().requires_grad_()
            y_ref = reference(xq, pr, ids, keep, w1, w2)
            (y_ref * g).sum().backward()
            r = routings[rank]
            x_l = x[mine].clone().requires_grad_()
            p_l = probs[mine].clone().requires_grad_()
            routing = type(r)(p_l, r.expert_ids_TK, r.tokens_per_expert_E, r.keep_TK, r.capacity, r.pad_to_capacity)
            got = fp8.dispatch(x_l, routing)
            want = plain.dispatch(x[mine], routing)
            # what arrives is exactly the e4m3 cast of what the plain dispatcher delivers
            if not torch.equal(got.tokens_NH, _qdq(want.tokens_NH)):
                failures.append(f"{tag}: dispatched tokens are not the e4m3 casts of the plain ones")
            per = got.tokens_per_expert_e.tolist()
            expert_out = run_experts(got.tokens_NH, per, fp8.local_expert_offset, w1, w2,
                                     etp=dims.etp, etp_rank=dims.etp_rank, probs_N=got.probs_N)
            y = fp8.combine(expert_out, got.handle)
            (y * g[mine]).sum().backward()
            checks = (("y", y.detach(), y_ref.detach()[mine]), ("dx", x_l.grad, xq.grad[mine]),
                      ("dprobs", p_l.grad, pr.grad[mine]))
            for what, a, b in checks:
                if not torch.allclose(a, b, atol=1e-5, rtol=1e-5):
                    failures.append(f"{tag}: {what} differs by {(a - b).abs().max().item():.3g}")
    return failures


def test_fp8_dispatch_round_trip_on_4_ranks():
    failures = [f for rank_failures in run_distributed(_check_all, 4, timeout=240) for f in rank_failures]
    assert not failures, "\n".join(failures[:20])


def test_bench_dispatch_fp8(capfd):
    """In process (one rank, the local dispatcher: FP8 casts every row there too); the multi-rank path is the
    same code after the plain dispatcher's measurements (tests/tools/test_bench_dispatch.py spawns ranks)."""
    argv = ["bench-dispatch", "--num-tokens", "64", "--hidden", "256", "--num-experts", "4", "--topk", "2",
            "--iters", "2", "--warmup", "1", "--ep", "1", "--dispatcher", "local", "--dtype", "bf16", "--fp8"]
    args: argparse.Namespace = build_parser("bench-dispatch").parse_args(argv)
    assert bench_dispatch.main(args) == 0
    out = capfd.readouterr().out
    assert "fp8 local dispatch+combine" in out and "dispatch bytes 0.52x" in out, out
