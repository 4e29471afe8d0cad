"""Issue 33's families (GPT-OSS, GLM-4.5, Kimi-K2, OLMoE, MiniMax-M2) at parallel layouts, in ONE 4-rank world.

- logits of each family's tiny HF checkpoint (transformers' own config classes) equal transformers' at tp2, ep2,
  pp2 and cp2 (every family: all their attentions take CP), and at the layouts that exercise a new feature
  further: tp4 (kv heads replicated: the qk-norm over the whole projection projects every kv head), tp2 without
  SP, etp2 x ep2 with the alltoall and allgather dispatchers (GPT-OSS's expert biases, the down bias added once
  over etp), cp2 all_gather (sinks with the
  sliding window), tp2 x cp2 x ep2, pp2 x tp2;
- loss and every parameter's gradient equal world 1's at tp2 / tp4 (projection qk-norm: the sum of squares
  all-reduced over tp, its gradient too), cp2 p2p and all_gather (sinks: their gradient is a partial sum over
  cp), etp2 x ep2 (expert biases) and tp2 x cp2 x ep2;
- the HF export from etp2 x ep2 (GPT-OSS's interleaved gate/up read and written in etp slices) is bit-exact.

Gradients are reduced by the trainer's ``GradSync`` and gathered to full shape; each dp rank runs its own
micro-batch and world 1 averages them (as tests/models/test_parallel.py does).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from moefold.dense.context_parallel import split_for_context_parallel
from moefold.execution import ExecutionPlan, apply_execution
from moefold.models.hf.exporter import export_hf
from moefold.models.hf.importer import import_hf, load_config, load_hf_weights
from moefold.models.options import ModelOptions
from moefold.models.tensor_io import TensorReader
from moefold.parallel.comm import gather_along_dim
from moefold.parallel.dims import ParallelDims
from moefold.parallel.sharding import gather_full, shards_of
from moefold.pipeline.decoder_stage import DecoderStage, build_stage_model
from moefold.pipeline.p2p import recv_forward, send_forward
from moefold.pipeline.stages import StageLayout
from moefold.training.optim.grad_sync import GradSync
from tests.distributed import LayoutDims, run_distributed
from tests.models.hf_tiny import FEATURE_FAMILIES, VOCAB, save_all, tokens
from tests.tolerance import assert_within_fp32_noise, reference_steps

pytest.importorskip("transformers")

TOL = 1e-5
LOGIT_LAYOUTS = [  # (label, ParallelConfig kwargs, ModelOptions kwargs, families)
    ("tp2", dict(tp=2), {}, FEATURE_FAMILIES),
    ("ep2", dict(ep=2), {}, FEATURE_FAMILIES),
    ("pp2", dict(pp=2), {}, FEATURE_FAMILIES),
    ("cp2", dict(cp=2), {}, FEATURE_FAMILIES),
    ("tp4", dict(tp=4), {}, ("gpt_oss", "glm4_moe", "olmoe", "minimax_m2")),
    ("tp2 no-SP", dict(tp=2), dict(sequence_parallel=False), ("olmoe", "minimax_m2")),
    ("etp2xep2", dict(ep=2, etp=2), {}, ("gpt_oss", "glm4_moe")),
    ("etp2xep2 allgather", dict(ep=2, etp=2), dict(dispatcher="allgather"), ("gpt_oss",)),
    ("cp2 all_gather", dict(cp=2), dict(cp_comm="all_gather"), ("gpt_oss",)),
    ("tp2xcp2xep2", dict(tp=2, cp=2, ep=2), {}, ("gpt_oss", "glm4_moe", "kimi_k2")),
    ("pp2xtp2", dict(pp=2, tp=2), {}, ("gpt_oss", "minimax_m2")),
]
GRAD_LAYOUTS = [
    ("tp2", dict(tp=2), {}, ("gpt_oss", "minimax_m2")),
    ("tp4", dict(tp=4), {}, ("olmoe",)),
    ("cp2", dict(cp=2), {}, ("gpt_oss",)),
    ("cp2 all_gather", dict(cp=2), dict(cp_comm="all_gather"), ("gpt_oss",)),
    ("etp2xep2", dict(ep=2, etp=2), {}, ("gpt_oss",)),
    ("tp2xcp2xep2", dict(tp=2, cp=2, ep=2), {}, ("gpt_oss", "glm4_moe")),
]


def _batch(dp_rank: int, cp_rank: int = 0, cp: int = 1):
    g = torch.Generator().manual_seed(500 + dp_rank)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels = torch.randint(0, VOCAB, (2, 16), generator=g)
    mask = (torch.rand(2, 16, generator=g) > 0.2).float()
    return tuple(split_for_context_parallel(t, cp_rank, cp, seq_dim=1) for t in (ids, labels, mask))


def _pipeline_logits(path: str, dims: ParallelDims, options: ModelOptions, ids: torch.Tensor) -> torch.Tensor | None:
    """Full logits on the last pipeline stage (None on the others): stage 0 embeds and runs its layers, sends the
    hidden state; stage 1 receives it and runs its layers and the head."""
    config = load_config(path)
    L = config.num_layers   # 3 layers (GLM, Kimi): the dense one on stage 0, the MoE ones on stage 1
    layout = StageLayout(L, dims.pp, first_stage_layers=L // 2 if L % 2 else None)
    model = build_stage_model(config, dims, options, layout)
    apply_execution(model, ExecutionPlan(options), dims)
    load_hf_weights(model, path)
    positions = model.position_ids(ids.shape[1], ids.device)
    with torch.no_grad():
        if dims.pp_rank == 0:
            hidden, _ = model.run_layers(model.embed(ids), positions)
            send_forward(hidden, dims.pp_group).wait()
            return None
        spec = DecoderStage(model, layout, dims.pp_rank).activation_spec(ids.shape[0], ids.shape[1])
        hidden, handle = recv_forward(spec, dims.pp_group)
        handle.wait()
        hidden, _ = model.run_layers(hidden, positions)
        logits = model.head_logits(hidden).float()
    return gather_along_dim(logits, dims.tp_group, dim=-1).transpose(0, 1)


def _logits(path: str, dims: ParallelDims, options: ModelOptions, ids: torch.Tensor) -> torch.Tensor | None:
    if dims.pp > 1:
        return _pipeline_logits(path, dims, options, ids)
    model = import_hf(path, dims, options)
    return model.logits(split_for_context_parallel(ids, dims.cp_rank, dims.cp, seq_dim=1))


def _grads(path: str, dims: ParallelDims, options: ModelOptions):
    """(this rank's micro-batch loss total, full gradients) after one backward at ``dims``."""
    model = import_hf(path, dims, options)
    sync = GradSync(model.named_parameters(), dims)
    sync.start_step(1)
    out = model(*_batch(dims.dp_rank, dims.cp_rank, dims.cp))
    out.loss.backward()
    sync.finish()
    params = dict(model.named_parameters())
    grads = {n: gather_full(g, shards_of(params[n])) for n, g in sync.gathered_grads().items()}
    # the micro-batch loss: lm shares identical over tp, MoE shares add up over tp x cp, cp holds sequence parts
    lm, aux = out.loss.detach() - out.aux_loss, out.aux_loss.clone()
    if dims.tp > 1:
        dist.all_reduce(aux, group=dims.tp_group)
    total = lm + aux
    if dims.cp > 1:
        dist.all_reduce(total, group=dims.cp_group)
    return total, grads


def _reference_grads(path: str, dp: int):
    """World 1 per micro-batch: (fp32 losses, fp32 gradients, float64 gradients: the exact values the fp32 ones
    round, which size the tolerance: tests/tolerance.py)."""
    return reference_steps(lambda: import_hf(path), [_batch(dp_rank) for dp_rank in range(dp)])


def _rank(dirs: dict[str, str], refs: dict[str, torch.Tensor], ids: torch.Tensor, out_dir: str):
    report, dims_for, seconds = {}, LayoutDims(), {}


    for label, par, opts, families in LOGIT_LAYOUTS:
        dims, options = dims_for(par), ModelOptions(**opts)
        for family in families:
            start = time.perf_counter()
            logits = _logits(dirs[family], dims, options, ids)
            if logits is not None:
                diff = (logits - refs[family]).abs().max().item()
                report[f"{family} {label}"] = diff
                assert diff <= TOL, (family, label, diff)
            seconds[family] = seconds.get(family, 0.0) + time.perf_counter() - start
    # the GPT-OSS export from etp2 x ep2 (etp slices of the interleaved gate/up)
    export_hf(import_hf(dirs["gpt_oss"], dims_for(dict(ep=2, etp=2))), out_dir)

    references = {}
    for label, par, opts, families in GRAD_LAYOUTS:
        dims, options = dims_for(par), ModelOptions(**opts)
        for family in families:
            start = time.perf_counter()
            if family not in references:
                references[family] = _reference_grads(dirs[family], 4)
            ref_losses, mb_grads, mb_grads64 = references[family]
            total, grads = _grads(dirs[family], dims, options)
            torch.testing.assert_close(total, ref_losses[dims.dp_rank], atol=1e-6, rtol=1e-6)
            ref, ref64 = ({n: sum(mb[r][n] for r in range(dims.dp)) / dims.dp for n in mb[0]}
                          for mb in (mb_grads, mb_grads64))
            # each parameter within a few times fp32's own error on it (some gradients cancel to ~1e-5 of their terms)
            report[f"grads {family} {label}"] = assert_within_fp32_noise(grads, ref, ref64, f"{family} {label}")
            seconds[family] = seconds.get(family, 0.0) + time.perf_counter() - start
    return report, seconds


def test_families_parallel_layouts_equal_transformers(tmp_path):
    ids = tokens(seq=16)
    dirs, refs = save_all(FEATURE_FAMILIES, tmp_path, ids)
    out_dir = str(tmp_path / "export")
    reports = run_distributed(_rank, 4, dirs, refs, ids, out_dir, timeout=600)
    report = {}   # the largest difference over the ranks (pp2 logits exist on the last stage's ranks only)
    for rank_report, _ in reports:
        for key, value in rank_report.items():
            report[key] = max(report.get(key, 0.0), value)
    for key, value in sorted(report.items()):
        print(f"{key}: max |diff| = {value:.3g}")
    print("seconds per family on rank 0:", {k: round(v, 1) for k, v in reports[0][1].items()})
    for family in FEATURE_FAMILIES:   # the layouts, every family
        assert {f"{family} {label}" for label in ("tp2", "ep2", "pp2", "cp2")} <= set(report), family
    with TensorReader(dirs["gpt_oss"]) as a, TensorReader(out_dir) as b:
        assert sorted(a.names()) == sorted(b.names())
        for name in a.names():
            assert torch.equal(a.read(name), b.read(name)), name
