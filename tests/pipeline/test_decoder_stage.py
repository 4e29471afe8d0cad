"""The MoE decoder pipelined (pp2 x tp2, pp2 x ep2 x dp2; 1F1B, interleaved, GPipe) equals world 1.

DeepSeek-V3 tiny recipe (MLA, dense first layer, MoE with aux loss, 1 MTP depth), and Qwen3-Next's (Gated
DeltaNet and gated attention layers on both stages) at pp2 x tp2 with interleaving, in ONE 4-rank
world. Gradients are reduced by the trainer's ``GradSync`` (sequence-parallel over tp x cp x dp,
dense over dp x cp, experts over edp, divided by dp) and gathered to full shape; a parameter on
two stages (the embedding, which the last stage holds for MTP) has its gradients summed over them
here.
"""

from __future__ import annotations

import pytest
import torch

from moefold.models.decoder import MoEDecoder
from moefold.models.options import ModelOptions
from moefold.models.recipes import deepseek_v3_tiny, qwen3_next_tiny
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import gather_full, shards_of
from moefold.pipeline.decoder_stage import DecoderStage, build_stage_model, decoder_microbatches
from moefold.pipeline.executor import run_schedule
from moefold.pipeline.schedules import build_schedule
from moefold.pipeline.stages import StageLayout
from moefold.training.optim.grad_sync import GradSync
from tests.distributed import run_distributed

M, B, S = 2, 2, 16
LAYOUTS = {  # name -> (ParallelConfig kwargs, schedule, vpp)
    "pp2xtp2-1f1b": (dict(pp=2, tp=2), "1f1b", 1),
    "pp2xtp2-interleaved-v2": (dict(pp=2, tp=2), "interleaved", 2),
    "pp2xep2xdp2-gpipe": (dict(pp=2, ep=2), "gpipe", 1),
    "qwen3_next-pp2xtp2-interleaved-v2": (dict(pp=2, tp=2), "interleaved", 2),
}


def _config(key: str = ""):
    if key.startswith("qwen3_next"):   # 4 layers: [DeltaNet, DeltaNet, DeltaNet, attention], one per chunk
        return qwen3_next_tiny().with_(moe_aux_loss_coeff=0.01, moe_load_balancing_type="aux_loss")
    return deepseek_v3_tiny().with_(num_layers=4, mtp_num_layers=1, moe_aux_loss_coeff=0.01)


def _batch(dp_rank: int):
    g = torch.Generator().manual_seed(300 + dp_rank)
    ids = torch.randint(0, 512, (M * B, S), generator=g)
    labels = torch.randint(0, 512, (M * B, S), generator=g)
    mask = (torch.rand(M * B, S, generator=g) > 0.2).float()
    return ids, labels, mask


def _reference(dp: int, key: str):
    model = MoEDecoder(_config(key), ParallelDims.single())
    model.init_weights(7)
    losses, lm, mtp, moe_layers = [], [], [], []
    for dp_rank in range(dp):
        for mb in decoder_microbatches(*_batch(dp_rank), M):
            out = model(mb["input_ids"], mb["labels"], mb["loss_mask"])
            (out.loss / (M * dp)).backward()
            losses.append((out.loss - out.aux_loss).detach())
            lm.append(out.lm_loss)
            mtp.append(out.mtp_loss)
            moe_layers = sorted(out.moe)
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}, lm, mtp, moe_layers


def _world() -> dict:
    out = {}
    grids: dict[tuple, ParallelDims] = {}
    for key, (par, name, vpp) in LAYOUTS.items():
        grid_key = tuple(sorted(par.items()))
        if grid_key not in grids:
            grids[grid_key] = ParallelDims.build(ParallelConfig(**par))
        dims = grids[grid_key]
        config = _config(key)
        layout = StageLayout(config.num_layers, dims.pp, vpp)
        model = build_stage_model(config, dims, ModelOptions(), layout)
        model.init_weights(7)
        stage = DecoderStage(model, layout, dims.pp_rank)
        microbatches = decoder_microbatches(*_batch(dims.dp_rank), M)
        sync = GradSync(model.named_parameters(), dims)
        sync.start_step(M)
        result = run_schedule(stage, build_schedule(name, dims.pp, M, vpp), microbatches, stage.loss_fn,
                              dims.pp_group, stage.activation_spec(B, S))
        sync.finish()
        params = dict(model.named_parameters())
        grads = {n: gather_full(g, shards_of(params[n])) for n, g in sync.gathered_grads().items()}
        out[key] = {"pp": dims.pp_rank, "dp": dims.dp_rank, "tp": dims.tp_rank, "losses": result.losses,
                    "grads": grads, "dp_size": dims.dp,
                    "lm": stage.lm_losses, "mtp": stage.mtp_losses, "moe_infos": sorted(stage.moe_infos),
                    "graph_free": all(i.aux_loss.grad_fn is None for i in stage.moe_infos.values())}
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_distributed(_world, 4, timeout=300)


@pytest.mark.parametrize("key", sorted(LAYOUTS))
def test_pipelined_decoder_equals_world1(world, key):
    ranks = [res[key] for res in world]
    dp = ranks[0]["dp_size"]
    ref_losses, ref_grads, ref_lm, ref_mtp, moe_layers = _reference(dp, key)
    grads: dict[str, torch.Tensor] = {}
    for pp_rank in range(2):  # one rank per stage (tp/dp peers hold the same reduced full gradients)
        r = next(r for r in ranks if r["pp"] == pp_rank)
        for name, g in r["grads"].items():
            grads[name] = grads[name] + g if name in grads else g
    assert sorted(grads) == sorted(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{key} {n}: {m}")
    for r in ranks:
        if r["pp"] == 1:
            expected = torch.stack(ref_losses[r["dp"] * M:(r["dp"] + 1) * M])
            torch.testing.assert_close(torch.stack(r["losses"]), expected, atol=1e-5, rtol=1e-5)
            # the values kept for the trainer's metrics: per micro-batch LM and MTP losses
            for name, ref in (("lm", ref_lm), ("mtp", ref_mtp)) if _config(key).mtp_num_layers else (("lm", ref_lm),):
                got = torch.stack([r[name][i] for i in range(M)])
                torch.testing.assert_close(got, torch.stack(ref[r["dp"] * M:(r["dp"] + 1) * M]), atol=1e-5, rtol=1e-5)
        else:
            assert r["losses"] == [] and r["lm"] == {} and r["mtp"] == {}
    # every (micro-batch, MoE layer) info, each on the stage that holds the layer
    infos = sorted({key for r in ranks for key in r["moe_infos"]})
    assert infos == [(i, layer) for i in range(M) for layer in moe_layers]
    # kept without their graphs (which would keep each chunk's input and its gradient to the step's end)
    assert all(r["graph_free"] for r in ranks)
