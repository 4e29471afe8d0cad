"""The decoder at parallel layouts equals world 1, in ONE 4-rank world.

- HF checkpoints of all three families imported at tp2 x ep2 (SP, dp2 / edp2), and DeepSeek-V3 also at
  tp2 x cp2 x ep2 and Qwen3-MoE at tp2 x ep2 without SP: full logits equal HF's (|diff| <= 1e-5).
- Export from tp2 x ep2: bit-exact with the source checkpoint; a moefold checkpoint loads at
  tp2 x cp2 x ep2 (same logits) and saves back bit-exact.
- Training loss and every parameter's gradient (DeepSeek-V3 tiny recipe with 2 MTP depths, all MoE
  losses on) at tp2 x cp2 x ep2 and tp2 x ep2 x dp2 equal world 1. Gradients are reduced by the
  trainer's ``GradSync`` (sequence-parallel ones over tp x cp x dp, dense ones over dp x cp, expert ones
  over edp, divided by dp: each dp rank runs its own micro-batch; world 1 averages them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moefold.dense.context_parallel import split_for_context_parallel
from moefold.models.checkpoint import load_checkpoint, save_checkpoint
from moefold.models.decoder import MoEDecoder
from moefold.models.hf.exporter import export_hf
from moefold.models.hf.importer import import_hf
from moefold.models.options import ModelOptions
from moefold.models.recipes import deepseek_v3_tiny
from moefold.models.tensor_io import TensorReader
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import gather_full, shards_of
from moefold.training.optim.grad_sync import GradSync
from tests.distributed import run_distributed
from tests.models.hf_tiny import FAMILIES, save_all, tokens

TOL = 1e-5  # the issue asks for <= 1e-4; fp32 differences here are ~1e-6


def _batch(dims: ParallelDims | None, dp_rank: int, cp_rank: int, cp: int):
    g = torch.Generator().manual_seed(100 + dp_rank)
    ids = torch.randint(0, 512, (2, 16), generator=g)
    labels = torch.randint(0, 512, (2, 16), generator=g)
    mask = (torch.rand(2, 16, generator=g) > 0.2).float()
    return tuple(split_for_context_parallel(t, cp_rank, cp, seq_dim=1) for t in (ids, labels, mask))


def _train_step(config, dims: ParallelDims, options: ModelOptions):
    model = MoEDecoder(config, dims, options)
    model.init_weights(7)
    sync = GradSync(model.named_parameters(), dims)
    sync.start_step(1)
    out = model(*_batch(dims, dims.dp_rank, dims.cp_rank, dims.cp))
    out.loss.backward()
    sync.finish()
    params = dict(model.named_parameters())
    return out, {n: gather_full(g, shards_of(params[n])) for n, g in sync.gathered_grads().items()}


def _reference_step(config):
    """World 1, micro-batches 0 and 1 separately: (losses, gradients) of each."""
    model = MoEDecoder(config, ParallelDims.single())
    model.init_weights(7)
    losses, grads = [], []
    for dp_rank in range(2):
        model.zero_grad()
        out = model(*_batch(None, dp_rank, 0, 1))
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return losses, grads


def _rank(dirs: dict[str, str], refs: dict[str, torch.Tensor], ids: torch.Tensor, out_dir: str):
    report, cache = {}, {}

    def dims_for(**kw):
        key = tuple(sorted(kw.items()))
        if key not in cache:
            cache[key] = ParallelDims.build(ParallelConfig(**kw))
        return cache[key]

    # 1. logits parity with HF at parallel layouts
    layouts = [("tp2xep2", dict(tp=2, ep=2), ModelOptions(), FAMILIES),
               ("tp2xcp2xep2", dict(tp=2, cp=2, ep=2), ModelOptions(), ("deepseek_v3",)),
               ("tp2xep2 no-SP", dict(tp=2, ep=2), ModelOptions(sequence_parallel=False), ("qwen3_moe",)),
               ("cp2xep4 all_gather", dict(cp=2, ep=4), ModelOptions(cp_comm="all_gather"), ("mixtral",))]
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
    # moefold checkpoint: loaded at tp2 x cp2 x ep2, saved back from there
    dims = dims_for(tp=2, cp=2, ep=2)
    model = load_checkpoint(dirs["moefold"], dims)
    diff = (model.logits(split_for_context_parallel(ids, dims.cp_rank, 2, seq_dim=1)) - refs["deepseek_v3"]).abs().max()
    assert diff <= TOL, diff
    save_checkpoint(model, out_dir + "/moefold")
    # 2. loss and gradients equal world 1 (MTP, every MoE loss, CP and dp)
    config = deepseek_v3_tiny().with_(mtp_num_layers=2, num_layers=2, moe_aux_loss_coeff=0.01)
    ref_losses, mb_grads = _reference_step(config)
    for label, par, options in [("tp2xcp2xep2", dict(tp=2, cp=2, ep=2), ModelOptions()),
                                ("tp2xep2xdp2", dict(tp=2, ep=2), ModelOptions(recompute="full")),
                                ("cp2xdp2xep4", dict(cp=2, ep=4), ModelOptions(cp_comm="all_gather"))]:
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
        ref_grads = {n: sum(mb_grads[r][n] for r in range(dims.dp)) / dims.dp for n in mb_grads[0]}
        assert sorted(grads) == sorted(ref_grads)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-4,
                                       msg=lambda m, n=name: f"{label} {n}: {m}")
            # some gradients are ~1e-5 in all (MTP norms), where atol 1e-5 alone could not fail: each
            # parameter's largest error must also be tiny against its own largest gradient
            scale = ref_grads[name].abs().max().item()
            assert scale > 0, f"{label} {name}: zero reference gradient"
            err = (g - ref_grads[name]).abs().max().item()
            assert err <= 1e-5 * scale, f"{label} {name}: max |diff| {err:.3g} vs gradient scale {scale:.3g}"
        report[f"grads {label}"] = max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)
    return report


def test_parallel_layouts_equal_world1(tmp_path):
    ids = tokens(seq=16)
    dirs, refs = save_all(FAMILIES, tmp_path, ids)
    out_dir = str(tmp_path / "export")
    dirs["moefold"] = str(tmp_path / "moefold")
    save_checkpoint(import_hf(dirs["deepseek_v3"]), dirs["moefold"])
    reports = run_distributed(_rank, 4, dirs, refs, ids, out_dir, timeout=300)
    for key, value in reports[0].items():
        print(f"{key}: max |diff| = {value:.3g}")
    # the HF export from tp2 x ep2 and the moefold checkpoint saved from tp2 x cp2 x ep2 are bit-exact
    for src, out in ((dirs["deepseek_v3"], out_dir + "/hf"), (dirs["moefold"], out_dir + "/moefold")):
        with TensorReader(src) as a, TensorReader(out) as b:
            assert sorted(a.names()) == sorted(b.names())
            for name in a.names():
                assert torch.equal(a.read(name), b.read(name)), name
