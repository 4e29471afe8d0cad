"""Muon (``--optimizer muon``) equals a plain single-process Muon written here from the paper's formula, at many
layouts in one world; Newton-Schulz equals the paper's iteration; the whole-matrix layout gives each matrix one
owner; the flags reach the run config; bad settings fail with one line."""

from __future__ import annotations

import pytest
import torch

from moefold.models.decoder import MoEDecoder
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import named_full_params
from moefold.training.config import TrainConfig
from moefold.training.optim.buffers import ALIGN, WHOLE_SLACK
from moefold.training.optim.grad_sync import GradSync
from moefold.training.optim.muon import DistributedMuon, MuonOptions, is_muon_matrix
from moefold.training.optim.newton_schulz import COEFFICIENTS, ScaleMode, TPMode, coefficients, newton_schulz
from moefold.training.optim.optimizer import decays
from tests.distributed import run_distributed
from tests.training.optim.random_grads import set_random_grads, step_both

WD, LR, BETA = 0.1, 1e-2, 0.9


def paper_newton_schulz(G: torch.Tensor, steps: int, kind: str) -> torch.Tensor:
    """Keller Jordan's ``zeropower_via_newtonschulz5`` (float64, one matrix), with ``kind``'s coefficients and the
    norm floored at 1e-7 as emerging_optimizers does (Keller Jordan adds 1e-7 instead)."""
    X = G.double()
    if G.size(0) > G.size(1):
        X = X.T
    X = X / X.norm().clamp_min(1e-7)
    for a, b, c in coefficients(kind, steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.T if G.size(0) > G.size(1) else X


def paper_muon_step(w: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, lr: float, nesterov: bool) -> None:
    """One Muon step of matrix ``w`` (in place): decoupled decay, EMA momentum, Newton-Schulz, spectral scale."""
    w.mul_(1 - lr * WD)
    buf.mul_(BETA).add_(g, alpha=1 - BETA)
    update = g + BETA * (buf - g) if nesterov else buf
    rows, cols = w.shape
    w.add_(paper_newton_schulz(update, 5, "quintic").to(w.dtype), alpha=-lr * max(rows, cols) ** 0.5)


def matrices(name: str, t: torch.Tensor) -> torch.Tensor:
    """The matrices Muon orthogonalises one by one: experts' ``[e, (G,) rows, cols]`` flattened to a batch."""
    return t.reshape(-1, *t.shape[-2:])


def _compare(layouts: list[ParallelConfig], nesterov: bool = True, mode: TPMode = TPMode.DUPLICATED,
             bf16: bool = False) -> list[float]:
    out = []
    for pc in layouts:
        dims = ParallelDims.build(pc)
        model = MoEDecoder(get_recipe("deepseek_v3_tiny").with_(num_layers=2, vocab_size=256), dims)
        model.init_weights(3)
        if bf16:
            model.to(torch.bfloat16)
        sync = GradSync(model.named_parameters(), dims, whole=is_muon_matrix)
        options = MuonOptions(momentum=BETA, use_nesterov=nesterov, tp_mode=mode, fp32_matmul_prec="highest")
        opt = DistributedMuon(sync, dims, options=options, weight_decay=WD)
        ref = {n: p.clone().float() for n, p in named_full_params(model).items()}
        params = dict(model.named_parameters())
        muon = {n for n, p in params.items() if is_muon_matrix(n, p)}
        adam_params = {n: ref[n].requires_grad_(True) for n in ref if n not in muon}
        groups = [{"params": [p for n, p in adam_params.items() if d == decays(n, p)], "weight_decay": WD * d}
                  for d in (True, False)]
        ref_adam = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8, foreach=False)
        bufs = {n: torch.zeros_like(matrices(n, ref[n]), dtype=torch.float64) for n in muon}
        for step in range(3):
            full_grads = set_random_grads(params, step, opt, pc)
            lr, coef = step_both(opt, ref_adam, adam_params, full_grads, step, LR)
            with torch.no_grad():
                for name in muon:
                    w, g = matrices(name, ref[name]), matrices(name, full_grads[name] * coef).double()
                    for i in range(w.size(0)):
                        paper_muon_step(w[i], g[i], bufs[name][i], lr, nesterov)
        got = named_full_params(model)
        worst = max((got[n] - p.detach()).abs().max().item() for n, p in ref.items())
        out.append(worst)
    return out


# the update is lr * sqrt(max(rows, cols)) * NS(.) with entries <= 1: fp32 rounding of the Newton-Schulz products
# (sums of <= 128 terms, 5 steps) times that scale stays far below 1e-5 after 3 steps
TOL = 1e-5


def test_muon_equals_the_papers_muon_at_every_layout():
    """One 4-rank world: tp, ep, etp, cp and dp layouts (tp-split matrices gathered: ``duplicated``) against the
    plain Muon above on the full matrices; world 1 in the same process."""
    layouts = [ParallelConfig(tp=2, ep=2), ParallelConfig(etp=2, ep=2), ParallelConfig(cp=2, tp=2),
               ParallelConfig(ep=4), ParallelConfig()]
    results = run_distributed(_compare, 4, layouts, timeout=300)
    assert all(w <= TOL for r in results for w in r), results
    assert _compare([ParallelConfig()], nesterov=False)[0] <= TOL


def test_distributed_tp_mode_equals_the_papers_muon():
    """``--muon-tp-mode distributed``: the Gram matrices all-reduced over tp equal the whole matrix's iteration."""
    results = run_distributed(_compare, 2, [ParallelConfig(tp=2, etp=2)], True, TPMode.DISTRIBUTED, timeout=300)
    assert all(w <= TOL for r in results for w in r), results


def test_newton_schulz_equals_the_paper_iteration_over_shapes_and_coefficients():
    gen = torch.Generator().manual_seed(0)
    for kind in COEFFICIENTS:
        for shape in ((8, 8), (16, 4), (4, 24), (33, 17)):
            G = torch.randn(shape, generator=gen) * 10.0 ** float(torch.randint(-3, 3, (), generator=gen))
            want = paper_newton_schulz(G, 5, kind)
            # the same formula: float64 agrees to float64 rounding (the sets with large first coefficients, cans
            # and polar_express, amplify an fp32 rounding more than 100-fold, so fp32 is checked on the others)
            assert (newton_schulz(G.double(), 5, kind) - want).abs().max() <= 1e-12, (kind, shape)
            if kind in ("simple", "quintic"):
                assert (newton_schulz(G, 5, kind).double() - want).abs().max() <= 1e-5, (kind, shape)
    # a batch is orthogonalised matrix by matrix; bf16 ("medium") stays within bf16's rounding of the fp32 result
    batch = torch.randn(3, 2, 6, 10, generator=gen)
    got = newton_schulz(batch, 5, "quintic")
    for i in range(3):
        for j in range(2):
            assert torch.allclose(got[i, j], newton_schulz(batch[i, j], 5, "quintic"), atol=1e-6)
    assert (newton_schulz(batch, 5, "quintic", bf16=True) - got).abs().max() <= 0.1
    # the quintic iteration drives every singular value into its band around 1 (Muon's approximate U V^T)
    s = torch.linalg.svdvals(newton_schulz(torch.randn(32, 48, generator=gen), 5, "quintic"))
    assert s.min() > 0.6 and s.max() < 1.25, s


def test_each_matrix_has_one_owner_and_adamw_keeps_the_rest():
    def owners(_unused: int) -> dict[str, int]:
        dims = ParallelDims.build(ParallelConfig())
        model = MoEDecoder(get_recipe("qwen3_moe_tiny").with_(num_layers=2, vocab_size=256), dims)
        sync = GradSync(model.named_parameters(), dims, whole=is_muon_matrix, bucket_numel=1000)
        mine = {}
        for g in sync.groups:
            assert g.whole == all(is_muon_matrix(n, p) for n, p in zip(g.names, g.params))
            for b in g.buckets[:-1] if g.whole else ():   # the chunks even out: little padding but in the last
                held = sum(-(-g.params[i].numel() // ALIGN) * ALIGN for i in b.params)
                assert b.end - b.start - held <= held // WHOLE_SLACK, (g.kind, b.end - b.start, held)
            for b in g.buckets:
                for i, lo, hi in g.pieces(b):
                    if g.whole:
                        assert (lo, hi) == (0, g.params[i].numel())
                        mine[g.names[i]] = dims.rank
        return mine

    per_rank = run_distributed(owners, 4, 0, timeout=120)
    names = [n for r in per_rank for n in r]
    assert len(names) == len(set(names)), "a matrix owned twice"
    assert all(len(r) >= 3 for r in per_rank), [len(r) for r in per_rank]   # every rank owns some matrices
    model = MoEDecoder(get_recipe("qwen3_moe_tiny").with_(num_layers=2, vocab_size=256), ParallelDims.single())
    muon = {n for n, p in model.named_parameters() if is_muon_matrix(n, p)}
    assert set(names) == muon
    assert "layers.0.self_attn.q_proj.weight" in muon and "layers.0.mlp.experts.w13" in muon
    assert not any(k in n for n in muon for k in ("embed_tokens", "output_head", "router", "norm"))


def test_muon_flags_reach_the_run_config_and_bad_values_fail():
    from moefold.training.cli.train import config_from_args, train_parser

    args = train_parser().parse_args(["--recipe", "qwen3_moe_tiny", "--optimizer", "muon", "--muon-momentum", "0.9",
                                      "--muon-use-nesterov", "--muon-num-ns-steps", "6", "--muon-tp-mode",
                                      "duplicated", "--muon-scale-mode", "shape_scaling",
                                      "--muon-extra-scale-factor", "0.2", "--muon-coefficient-type", "simple",
                                      "--muon-fp32-matmul-prec", "highest"])
    t = config_from_args(args).train
    assert t.muon_options() == MuonOptions(momentum=0.9, use_nesterov=True, num_ns_steps=6,
                                           tp_mode=TPMode.DUPLICATED, scale_mode=ScaleMode.SHAPE_SCALING,
                                           extra_scale_factor=0.2, coefficient_type="simple",
                                           fp32_matmul_prec="highest")
    assert TrainConfig().muon_options() is None
    for bad, match in (({"optimizer_type": "lion"}, "--optimizer='lion'"), ({"muon_momentum": 1.0}, "--muon-momentum"),
                       ({"muon_tp_mode": "x"}, "--muon-tp-mode"), ({"muon_num_ns_steps": 0}, "--muon-num-ns-steps"),
                       ({"use_torch_fsdp2": True}, "--use-torch-fsdp2")):
        with pytest.raises(ValueError, match=match):
            TrainConfig(**{"optimizer_type": "muon", **bad})


def test_bf16_momentum_halves_the_state_and_steps_within_bf16_rounding():
    """``--exp-avg-dtype bf16`` (Megatron's precision-aware optimizer) keeps Muon's momentum in bf16: half the
    bytes, and weights within the band one bf16 rounding of the momentum moves Newton-Schulz's output."""
    from moefold.training.optim.precision import OptimizerPrecision

    runs = {}
    for dtype in ("fp32", "bf16"):
        dims = ParallelDims.single()
        model = MoEDecoder(get_recipe("qwen3_moe_tiny").with_(num_layers=2, vocab_size=256), dims)
        model.init_weights(3)
        sync = GradSync(model.named_parameters(), dims, whole=is_muon_matrix)
        opt = DistributedMuon(sync, dims, options=MuonOptions(fp32_matmul_prec="highest"), weight_decay=WD,
                              precision=OptimizerPrecision(exp_avg_dtype=dtype))
        params = dict(model.named_parameters())
        for step in range(3):
            set_random_grads(params, step, opt, dtype)
            opt.step(LR, 1.0)
        assert {m.momentum.dtype for m in opt.matrices} == {torch.bfloat16 if dtype == "bf16" else torch.float32}
        runs[dtype] = ({n: p.detach().clone() for n, p in params.items()}, sum(m.momentum.nbytes for m in opt.matrices))
    (fp32, fp32_bytes), (bf16, bf16_bytes) = runs["fp32"], runs["bf16"]
    assert bf16_bytes * 2 == fp32_bytes
    # per step: lr * sqrt(max(rows, cols)) (1e-2 * 8: the matrices are at most 64 wide) times Newton-Schulz's
    # response to a 2^-8 relative change of its input (at most twice that); AdamW's bf16 moments move less
    worst = max((fp32[n] - bf16[n]).abs().max().item() for n in fp32)
    print(f"bf16 momentum: largest weight difference {worst:.2e} after 3 steps")
    assert 0 < worst <= 3 * LR * 8 * 2 ** -7, worst
