"""DeepSeek-V4 at parallel layouts, in ONE 4-rank world: what the compressed attention allows.

- logits of a tiny HF checkpoint (``save_pretrained`` of ``DeepseekV4ForCausalLM``: every attention kind, a
  hash-routed and two top-k MoE layers, 3 mHC streams) equal transformers' at ep2, ep4, etp2 x ep2 (alltoall and
  allgather dispatchers), pp2 (the streams ``[S, B, N, H]`` and the token ids crossing stages) and pp2 x ep2;
- loss and every gradient equal world 1's at ep2, ep4 and etp2 x ep2 (dp on the other ranks), and through the
  pipeline schedules (``DecoderStage``: 1F1B at pp2, GPipe at pp2 x ep2, two micro-batches);
- tp and cp are refused at start-up in one line (the compressed attention holds every head and the whole sequence).
"""

from __future__ import annotations

import pytest
import torch

from moefold.execution import ExecutionPlan, apply_execution
from moefold.models.hf.importer import import_hf, load_config, load_hf_weights
from moefold.models.options import ModelOptions
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import gather_full, shards_of
from moefold.pipeline.decoder_stage import DecoderStage, build_stage_model, decoder_microbatches
from moefold.pipeline.executor import run_schedule
from moefold.pipeline.p2p import recv_forward, send_forward
from moefold.pipeline.schedules import build_schedule
from moefold.pipeline.stages import StageLayout
from moefold.training.optim.grad_sync import GradSync
from tests.distributed import LayoutDims, run_distributed
from tests.models.test_deepseek_v4_model import _pair
from tests.tolerance import assert_within_fp32_noise

pytest.importorskip("transformers")

TOL, V, S = 1e-5, 48, 12
LOGIT_LAYOUTS = [("ep2", dict(ep=2), {}), ("ep4", dict(ep=4), {}), ("etp2xep2", dict(ep=2, etp=2), {}),
                 ("etp2xep2 allgather", dict(ep=2, etp=2), dict(dispatcher="allgather")), ("pp2", dict(pp=2), {}),
                 ("pp2xep2", dict(pp=2, ep=2), {})]
GRAD_LAYOUTS = [("ep2", dict(ep=2)), ("ep4", dict(ep=4)), ("etp2xep2", dict(ep=2, etp=2))]
SCHEDULES = [("pp2 1f1b", dict(pp=2), "1f1b"), ("pp2xep2 gpipe", dict(pp=2, ep=2), "gpipe")]   # 2 micro-batches


def _batch(dp_rank: int):
    g = torch.Generator().manual_seed(700 + dp_rank)
    ids = torch.randint(0, V, (2, S), generator=g)
    return ids, torch.randint(0, V, (2, S), generator=g), (torch.rand(2, S, generator=g) > 0.2).float()


def _pipeline_logits(path: str, dims: ParallelDims, options: ModelOptions, ids: torch.Tensor) -> torch.Tensor | None:
    config = load_config(path)
    layout = StageLayout(config.num_layers, dims.pp)
    model = build_stage_model(config, dims, options, layout)
    apply_execution(model, ExecutionPlan(options), dims)
    load_hf_weights(model, path)
    positions = model.position_ids(ids.shape[1], ids.device)
    with torch.no_grad():
        if dims.pp_rank == 0:
            hidden, _ = model.run_layers(model.embed(ids), positions, token_ids_BS=ids)
            send_forward(hidden, dims.pp_group).wait()
            return None
        spec = DecoderStage(model, layout, dims.pp_rank).activation_spec(ids.shape[0], ids.shape[1])
        hidden, handle = recv_forward(spec, dims.pp_group)
        handle.wait()
        hidden, _ = model.run_layers(hidden, positions, token_ids_BS=ids)
        return model.head_logits(hidden).float().transpose(0, 1)


def _grads(path: str, dims: ParallelDims):
    model = import_hf(path, dims)
    sync = GradSync(model.named_parameters(), dims)
    sync.start_step(1)
    out = model(*_batch(dims.dp_rank))
    out.loss.backward()
    sync.finish()
    params = dict(model.named_parameters())
    grads = {n: gather_full(g, shards_of(params[n])) for n, g in sync.gathered_grads().items()}
    return out.loss.detach(), grads


def _reference(path: str, dp: int):
    """World 1, the dp micro-batches averaged: (losses, fp32 grads, float64 grads). The lightning indexer has no
    gradient (its top-k selection passes none; as in transformers)."""
    losses, out = [], []
    for dtype in (torch.float32, torch.float64):
        model = import_hf(path).to(dtype)
        sums: dict[str, torch.Tensor] = {}
        for r in range(dp):
            ids, labels, mask = _batch(r)
            model.zero_grad()
            loss = model(ids, labels, mask.to(dtype)).loss
            loss.backward()
            if dtype == torch.float32:
                losses.append(loss.detach())
            for n, p in model.named_parameters():
                if p.grad is not None:
                    sums[n] = sums.get(n, 0) + p.grad.detach() / dp
        out.append(sums)
    return losses, out[0], out[1]


def _scheduled(path: str, dims: ParallelDims, schedule: str):
    """One pipelined step (``DecoderStage`` under ``schedule``, 2 micro-batches of this dp rank's batch) against
    world 1 over the same micro-batches: (this stage's gradients, world 1's)."""
    config = load_config(path)
    layout = StageLayout(config.num_layers, dims.pp)
    model = build_stage_model(config, dims, ModelOptions(), layout)
    load_hf_weights(model, path)
    stage = DecoderStage(model, layout, dims.pp_rank)
    ids, labels, mask = (torch.cat([t, t.flip(0)]) for t in _batch(dims.dp_rank))   # 4 sequences: 2 x 2
    microbatches = decoder_microbatches(ids, labels, mask, 2)
    sync = GradSync(model.named_parameters(), dims)
    sync.start_step(2)
    run_schedule(stage, build_schedule(schedule, dims.pp, 2, 1), microbatches, stage.loss_fn, dims.pp_group,
                 stage.activation_spec(2, S))
    sync.finish()
    params = dict(model.named_parameters())
    grads = {n: gather_full(g, shards_of(params[n])) for n, g in sync.gathered_grads().items()}
    ref = import_hf(path)
    for r in range(dims.dp):
        rids, rlabels, rmask = (torch.cat([t, t.flip(0)]) for t in _batch(r))
        for mb in decoder_microbatches(rids, rlabels, rmask, 2):
            (ref(mb["input_ids"], mb["labels"], mb["loss_mask"]).loss / (2 * dims.dp)).backward()
    return grads, {n: p.grad for n, p in ref.named_parameters() if n in grads and p.grad is not None}


def _rank(path: str, want: torch.Tensor, ids: torch.Tensor):
    report, dims_for = {}, LayoutDims()


    for label, par, opts in LOGIT_LAYOUTS:
        dims, options = dims_for(par), ModelOptions(**opts)
        logits = (_pipeline_logits(path, dims, options, ids) if dims.pp > 1 else
                  import_hf(path, dims, options).logits(ids))
        if logits is not None:
            report[label] = (logits - want).abs().max().item()
            assert report[label] <= TOL, (label, report[label])
    for label, par in GRAD_LAYOUTS:
        dims = dims_for(par)
        losses, ref, ref64 = _reference(path, dims.dp)
        loss, grads = _grads(path, dims)
        torch.testing.assert_close(loss, losses[dims.dp_rank], atol=1e-6, rtol=1e-6)
        grads = {n: g for n, g in grads.items() if n in ref}
        assert set(grads) == set(ref), label
        report[f"grads {label}"] = assert_within_fp32_noise(grads, ref, ref64, label)
    for label, par, schedule in SCHEDULES:
        grads, ref = _scheduled(path, dims_for(par), schedule)
        grads = {n: g for n, g in grads.items() if n in ref}
        assert grads and set(grads) == set(ref), label
        report[f"grads {label}"] = max((grads[n] - ref[n]).abs().max().item() for n in ref)
        assert report[f"grads {label}"] <= 1e-6, (label, report[f"grads {label}"])
    return report


def test_deepseek_v4_layouts_equal_transformers_and_world_1(tmp_path):
    _, _, hf, _ = _pair(6)   # heavily compressed, 2 compressed sparse, sliding; 2 hash layers; 2 streams
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    reports = run_distributed(_rank, 4, str(tmp_path / "hf"), want, ids, timeout=600)
    for key in sorted(reports[-1]):
        print(f"{key}: {max(r.get(key, 0.0) for r in reports):.3g}")


@pytest.mark.parametrize("par", [dict(tp=2), dict(cp=2)])
def test_tp_and_cp_are_refused_in_one_line(par):
    from moefold.models.layer_factory import check_layout
    from moefold.models.recipes import get_recipe

    dims = ParallelDims(sizes=ParallelConfig(**par).resolve(2))   # the sizes alone: refused before any group
    with pytest.raises(ValueError, match=r"^deepseek_v4_tiny: tp=\d, cp=\d: DeepSeek-V4's compressed attention "
                                         r"holds every head and the whole sequence on one rank"):
        check_layout(get_recipe("deepseek_v4_tiny"), dims, ModelOptions())
