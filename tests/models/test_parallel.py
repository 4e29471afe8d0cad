"""The decoder at parallel layouts equals world 1, in ONE 4-rank world.

- HF checkpoints of DeepSeek-V3, Qwen3-MoE, Mixtral and Qwen3-Next imported at tp2 x ep2 (SP, dp2 / edp2; the
  feature families' layouts are in tests/models/test_families_parallel.py), and DeepSeek-V3 also at
  tp2 x cp2 x ep2 and Qwen3-MoE at tp2 x ep2 without SP: full logits equal HF's (|diff| <= 1e-5).
- Export from tp2 x ep2: bit-exact with the source checkpoint; a moefold checkpoint loads at
  tp2 x cp2 x ep2 (same logits) and saves back bit-exact.
- Qwen3-Next (Gated DeltaNet + gated attention) imported at tp2 x ep2 with and without SP, ep2, cp2 (DeltaNet's
  head-parallel all-to-all; attention's p2p ring and all-gather) and pp2 x tp2 x ep2 (stages joined by
  point-to-point): full logits equal HF's; tp2 x cp2, which its 2 key heads cannot split over, is refused in
  one line. Qwen3.5-MoE (the same stack, DeltaNet's projections split in four HF tensors) at tp2 x ep2,
  cp2 x ep2 x dp2 and pp2 x tp2 x ep2, each rank reading its slices of the split tensors.
- Training loss and every parameter's gradient (DeepSeek-V3 tiny recipe with 2 MTP depths, all MoE
  losses on) at tp2 x cp2 x ep2 and tp2 x ep2 x dp2 equal world 1; so do Qwen3-Next's tiny recipe's at
  tp2 x ep2 x dp2 (SP, DeltaNet's delta rule recomputed), cp2 x ep2 x dp2 and ep2 x dp4, and Qwen3.5-MoE's at
  cp2 x ep2 x dp2. Gradients are reduced by the
  trainer's ``GradSync`` (sequence-parallel ones over tp x cp x dp, dense ones over dp x cp, expert ones
  over edp, divided by dp: each dp rank runs its own micro-batch; world 1 averages them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moefold.dense.context_parallel import split_for_context_parallel
from moefold.execution import build_decoder
from moefold.models.checkpoint import load_checkpoint, save_checkpoint
from moefold.models.decoder import MoEDecoder
from moefold.models.hf.exporter import export_hf
from moefold.models.hf.importer import import_hf, load_config, load_hf_weights
from moefold.models.options import ModelOptions
from moefold.models.recipes import deepseek_v3_tiny, qwen3_5_moe_tiny, qwen3_next_tiny
from moefold.models.tensor_io import TensorReader
from moefold.parallel.comm import gather_along_dim
from moefold.parallel.dims import ParallelDims
from moefold.parallel.sharding import gather_full, shards_of
from moefold.pipeline.decoder_stage import build_stage_model
from moefold.pipeline.p2p import TensorSpec, recv_forward, send_forward
from moefold.pipeline.stages import StageLayout
from moefold.training.optim.grad_sync import GradSync
from tests.distributed import LayoutDims, run_distributed
from tests.models.hf_tiny import FAMILIES, FEATURE_FAMILIES, save_all, tokens
from tests.tolerance import assert_within_fp32_noise, reference_steps

# the feature families' layouts: tests/models/test_families_parallel.py
FAMILIES_HERE = tuple(f for f in FAMILIES if f not in FEATURE_FAMILIES)

TOL = 1e-5  # the issue asks for <= 1e-4; fp32 differences here are ~1e-6


def _batch(dims: ParallelDims | None, dp_rank: int, cp_rank: int, cp: int):
    g = torch.Generator().manual_seed(100 + dp_rank)
    ids = torch.randint(0, 512, (2, 16), generator=g)
    labels = torch.randint(0, 512, (2, 16), generator=g)
    mask = (torch.rand(2, 16, generator=g) > 0.2).float()
    return tuple(split_for_context_parallel(t, cp_rank, cp, seq_dim=1) for t in (ids, labels, mask))


def _train_step(config, dims: ParallelDims, options: ModelOptions):
    model = build_decoder(config, dims, options)
    model.init_weights(7)
    sync = GradSync(model.named_parameters(), dims)
    sync.start_step(1)
    out = model(*_batch(dims, dims.dp_rank, dims.cp_rank, dims.cp))
    out.loss.backward()
    sync.finish()
    params = dict(model.named_parameters())
    return out, {n: gather_full(g, shards_of(params[n])) for n, g in sync.gathered_grads().items()}


def _reference_step(config, micro_batches: int = 2):
    """World 1, micro-batches 0 .. micro_batches-1 separately: (fp32 losses, fp32 gradients, float64 gradients of
    the same weights: the exact values, which size each gradient's tolerance: tests/tolerance.py) of each."""
    def build() -> MoEDecoder:
        model = MoEDecoder(config, ParallelDims.single())
        model.init_weights(7)
        return model

    return reference_steps(build, [_batch(None, dp_rank, 0, 1) for dp_rank in range(micro_batches)])


def _pipelined_logits(path: str, dims: ParallelDims, ids: torch.Tensor) -> torch.Tensor | None:
    """Full logits of the HF checkpoint ``path`` through pp stages (each rank reads its stage's weights); None
    off the last stage."""
    config = load_config(path)
    model = build_stage_model(config, dims, ModelOptions(), StageLayout(config.num_layers, dims.pp))
    load_hf_weights(model, path)
    positions = model.position_ids(ids.shape[1], ids.device)
    hidden = model.embed(ids) if dims.pp_rank == 0 else None
    if dims.pp_rank > 0:
        seq = ids.shape[1] // dims.tp if model.sequence_parallel else ids.shape[1]
        hidden, handle = recv_forward(TensorSpec((seq, ids.shape[0], config.hidden_size)), dims.pp_group)
        handle.wait()
    hidden, _ = model.run_layers(hidden, positions)
    if dims.pp_rank < dims.pp - 1:
        send_forward(hidden, dims.pp_group).wait()
        return None
    logits = gather_along_dim(model.head_logits(hidden).float(), dims.tp_group, dim=-1)
    return logits.transpose(0, 1)


def _rank(dirs: dict[str, str], refs: dict[str, torch.Tensor], ids: torch.Tensor, out_dir: str):
    report, dims_for = {}, LayoutDims()


    # 1. logits parity with HF at parallel layouts
    layouts = [("tp2xep2", dict(tp=2, ep=2), ModelOptions(), FAMILIES_HERE),
               ("tp2xcp2xep2", dict(tp=2, cp=2, ep=2), ModelOptions(), ("deepseek_v3",)),
               ("tp2xep2 no-SP", dict(tp=2, ep=2), ModelOptions(sequence_parallel=False), ("qwen3_moe", "qwen3_next")),
               ("ep2xdp4", dict(ep=2), ModelOptions(), ("qwen3_next",)),
               ("cp2xep2xdp2", dict(cp=2, ep=2), ModelOptions(), ("qwen3_next", "qwen3_5_moe")),
               ("cp2xep4 all_gather", dict(cp=2, ep=4), ModelOptions(cp_comm="all_gather"), ("mixtral", "qwen3_next"))]
    for label, par, options, families in layouts:
        dims = dims_for(**par)
        for family in families:
            model = import_hf(dirs[family], dims, options)
            pos_ids = split_for_context_parallel(ids, dims.cp_rank, dims.cp, seq_dim=1)
            diff = (model.logits(pos_ids) - refs[family]).abs().max().item()
            report[f"{family} {label}"] = diff
            assert diff <= TOL, (family, label, diff)
            if label == "tp2xep2" and family == "deepseek_v3":
                export_hf(model, out_dir + "/hf", max_shard_bytes=32 * 1024)
    # pipeline stages (DeltaNet and attention layers on both); a cp that DeltaNet's heads cannot split over
    for family in ("qwen3_next", "qwen3_5_moe"):
        logits = _pipelined_logits(dirs[family], dims_for(pp=2, tp=2, ep=2), ids)
        if logits is not None:
            report[f"{family} pp2xtp2xep2"] = diff = (logits - refs[family]).abs().max().item()
            assert diff <= TOL, (family, diff)
    try:
        import_hf(dirs["qwen3_next"], dims_for(tp=2, cp=2, ep=2))
    except ValueError as exc:
        report["qwen3_next tp2xcp2 refused"] = str(exc)
    # moefold checkpoint: loaded at tp2 x cp2 x ep2, saved back from there
    dims = dims_for(tp=2, cp=2, ep=2)
    model = load_checkpoint(dirs["moefold"], dims)
    diff = (model.logits(split_for_context_parallel(ids, dims.cp_rank, 2, seq_dim=1)) - refs["deepseek_v3"]).abs().max()
    assert diff <= TOL, diff
    save_checkpoint(model, out_dir + "/moefold")
    # 2. loss and gradients equal world 1 (MTP, every MoE loss, CP and dp; Qwen3-Next's hybrid stack)
    deepseek = deepseek_v3_tiny().with_(mtp_num_layers=2, num_layers=2, moe_aux_loss_coeff=0.01)
    # per-micro-batch aux loss: the recipe's global one counts over dp, which a world-1 micro-batch cannot see
    qwen3_next = qwen3_next_tiny().with_(moe_aux_loss_coeff=0.01, moe_load_balancing_type="aux_loss")
    qwen3_5 = qwen3_5_moe_tiny().with_(moe_aux_loss_coeff=0.01, moe_load_balancing_type="aux_loss")
    references = {id(deepseek): _reference_step(deepseek), id(qwen3_next): _reference_step(qwen3_next, 4),
                  id(qwen3_5): _reference_step(qwen3_5)}
    for config, label, par, options in [
            (deepseek, "tp2xcp2xep2", dict(tp=2, cp=2, ep=2), ModelOptions()),
            (deepseek, "tp2xep2xdp2", dict(tp=2, ep=2), ModelOptions(recompute="full")),
            (deepseek, "cp2xdp2xep4", dict(cp=2, ep=4), ModelOptions(cp_comm="all_gather")),
            (qwen3_next, "qwen3_next tp2xep2xdp2", dict(tp=2, ep=2), ModelOptions(recompute="selective")),
            (qwen3_next, "qwen3_next cp2xep2xdp2", dict(cp=2, ep=2), ModelOptions()),
            (qwen3_next, "qwen3_next ep2xdp4", dict(ep=2), ModelOptions()),
            (qwen3_5, "qwen3_5_moe cp2xep2xdp2", dict(cp=2, ep=2), ModelOptions())]:
        ref_losses, mb_grads, mb_grads64 = references[id(config)]
        dims = dims_for(**par)
        out, grads = _train_step(config, dims, options)
        # the micro-batch loss: lm/mtp shares are identical over tp, MoE shares add up over tp x cp
        lm = out.loss.detach() - out.aux_loss
        total = out.aux_loss.clone()
        if dims.tp > 1:
            dist.all_reduce(total, group=dims.tp_group)
        total = total + lm
        if dims.cp > 1:
            dist.all_reduce(total, group=dims.cp_group)
        torch.testing.assert_close(total, ref_losses[dims.dp_rank], atol=1e-6, rtol=1e-6)
        # world 1 averages the gradients of the micro-batches the dp ranks ran
        ref_grads, ref64 = ({n: sum(mb[r][n] for r in range(dims.dp)) / dims.dp for n in mb[0]}
                            for mb in (mb_grads, mb_grads64))
        for name, g in ref64.items():
            assert g.abs().max() > 0, f"{label} {name}: zero reference gradient"
        # each parameter within a few times fp32's own error on it (some gradients are ~1e-5 in all: MTP norms)
        report[f"grads {label}"] = assert_within_fp32_noise(grads, ref_grads, ref64, label)
    return report


def test_parallel_layouts_equal_world1(tmp_path):
    ids = tokens(seq=16)
    dirs, refs = save_all(FAMILIES_HERE, tmp_path, ids)
    out_dir = str(tmp_path / "export")
    dirs["moefold"] = str(tmp_path / "moefold")
    save_checkpoint(import_hf(dirs["deepseek_v3"]), dirs["moefold"])
    reports = run_distributed(_rank, 4, dirs, refs, ids, out_dir, timeout=300)
    refused = reports[0].pop("qwen3_next tp2xcp2 refused", "")
    assert "num_key_heads=2 / tp=2 is not divisible by cp=2" in refused and "\n" not in refused, refused
    # the last stage's first rank checked the logits
    assert "qwen3_next pp2xtp2xep2" in reports[2] and "qwen3_5_moe pp2xtp2xep2" in reports[2]
    for report in reports:
        report.pop("qwen3_next tp2xcp2 refused", None)
    for key, value in {**reports[0], **reports[2]}.items():
        print(f"{key}: max |diff| = {value:.3g}")
    # the HF export from tp2 x ep2 and the moefold checkpoint saved from tp2 x cp2 x ep2 are bit-exact
    for src, out in ((dirs["deepseek_v3"], out_dir + "/hf"), (dirs["moefold"], out_dir + "/moefold")):
        with TensorReader(src) as a, TensorReader(out) as b:
            assert sorted(a.names()) == sorted(b.names())
            for name in a.names():
                assert torch.equal(a.read(name), b.read(name)), name
