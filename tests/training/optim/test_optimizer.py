"""The distributed AdamW equals torch.optim.AdamW on the gathered full parameters at many layouts; its gradient
norm counts every element once; its memory falls with the group size; bf16 states train like fp32 ones; world 1
copies nothing; bytes per parameter; LR schedules."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moefold.models.decoder import MoEDecoder
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import named_full_params
from moefold.training.observe.memory import bytes_per_parameter, describe_static
from moefold.training.optim.grad_sync import GradSync
from moefold.training.optim.lr_schedule import LRSchedule
from moefold.training.optim.optimizer import DistributedAdamW, decays
from moefold.training.optim.precision import OptimizerPrecision
from tests.distributed import run_distributed
from tests.training.optim.random_grads import set_random_grads, step_both
from tests.training.trainer_common import run, tiny_config, tiny_data

TOL = 1e-6


def _compare(layouts: list[ParallelConfig]) -> list[tuple[float, float]]:
    out = []
    for pc in layouts:
        dims = ParallelDims.build(pc)
        model = MoEDecoder(get_recipe("deepseek_v3_tiny").with_(num_layers=2, vocab_size=256), dims)
        model.init_weights(3)
        sync = GradSync(model.named_parameters(), dims)
        opt = DistributedAdamW(sync, dims, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        ref = {n: p.clone().requires_grad_(True) for n, p in named_full_params(model).items()}
        groups = [{"params": [p for n, p in ref.items() if decays(n, p)], "weight_decay": 0.1},
                  {"params": [p for n, p in ref.items() if not decays(n, p)], "weight_decay": 0.0}]
        ref_opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
        params = dict(model.named_parameters())
        for step in range(3):
            step_both(opt, ref_opt, ref, set_random_grads(params, step, opt, pc), step, 1e-2)
        got = named_full_params(model)
        worst = max((got[n] - p.detach()).abs().max().item() for n, p in ref.items())
        assert worst <= TOL, (pc, worst)
        out.append((worst, opt.state_bytes()))
    return out


def test_distributed_adamw_equals_torch_adamw():
    # one world for every layout; the last one (dp4) measures the ZeRO-1 memory saving
    layouts = [ParallelConfig(tp=2, ep=2), ParallelConfig(etp=2, ep=2), ParallelConfig(cp=2, tp=2), ParallelConfig()]
    results = run_distributed(_compare, 4, layouts, timeout=300)
    assert len(results) == 4 and all(len(r) == len(layouts) for r in results)
    single = _compare([ParallelConfig()])[0][1]
    dp4 = results[0][-1][1]
    print(f"optimizer state per rank: world 1 {single} B, dp4 {dp4} B")
    assert dp4 <= single / 4 + 1024


def test_lr_schedules():
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=2, decay_iters=12, style="cosine")
    assert [s(0), s(1)] == [0.0, 0.5]   # Megatron's warmup: step 0 at --lr-warmup-init
    old = LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=2, decay_iters=12, style="cosine", warmup_skip_zero=True)
    assert [old(0), old(1), old(2)] == [0.5, 1.0, 1.0]
    assert LRSchedule(lr=1.0, warmup_iters=4, decay_iters=12, warmup_init=0.2)(2) == pytest.approx(0.6)
    assert s(2) == pytest.approx(1.0) and s(7) == pytest.approx(0.55) and s(12) == pytest.approx(0.1)
    lin = LRSchedule(lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=10, style="linear")
    assert lin(5) == pytest.approx(0.5)
    wsd = LRSchedule(lr=1.0, min_lr=0.0, warmup_iters=2, decay_iters=12, style="WSD", wsd_decay_iters=4)
    assert [wsd(i) for i in (2, 8)] == [1.0, 1.0] and wsd(9) == pytest.approx(0.75) and wsd(12) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="lr decay style 'cos'"):
        LRSchedule(lr=1.0, style="cos")


BF16_BAND = 0.03   # max |loss difference| over 50 steps (measured: 0.006); the last 10 steps' means within 0.01


def test_bf16_states_train_within_a_band_of_fp32():
    """50 steps of Qwen3-MoE tiny with bf16 exp_avg, exp_avg_sq and main grads stay within BF16_BAND of the
    fp32-state run (the loss falls by ~1.2 over them), with half the moment bytes."""
    data = np.concatenate([tiny_data(64)] * 4)
    common = dict(steps=50, recipe="qwen3_moe_tiny", micro_batch_size=4, global_batch_size=4, lr_warmup_iters=5)
    fp32, _, t32 = run(tiny_config(**common), data=data)
    bf16, _, t16 = run(tiny_config(**common, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16", main_grads_dtype="bf16"),
                       data=data)
    fp32, bf16 = torch.tensor(fp32), torch.tensor(bf16)
    diff = (bf16 - fp32).abs()
    print(f"bf16 states: max |loss diff| {diff.max():.4f} over 50 steps; loss {fp32[0]:.3f} -> {fp32[-1]:.3f} (fp32), "
          f"{bf16[-1]:.3f} (bf16)")
    assert fp32[-10:].mean() < fp32[:5].mean() - 0.5   # it trained
    assert diff.max() <= BF16_BAND and abs(bf16[-10:].mean() - fp32[-10:].mean()) <= 0.01
    assert t16.optimizer.state_bytes() * 2 == t32.optimizer.state_bytes()
    assert t16.sync.groups[0].grad_data.dtype == torch.bfloat16


def test_world_1_takes_no_copy_and_precision_accounting():
    """World 1, fp32: the parameters live in the flat buffer, AdamW updates them there (its parameters are views
    of the same memory), gradients accumulate straight into the main-grad buffer (fused GEMMs leave
    ``param.grad`` None, the others are bound to ``main_grad`` after their first copy), nothing is gathered. bf16
    parameters get a separate fp32 master. Bytes per parameter follow Megatron's table."""
    small = dict(steps=1, recipe="qwen3_moe_tiny", micro_batch_size=4, global_batch_size=4)
    _, _, trainer = run(tiny_config(**small))
    opt, sync = trainer.optimizer, trainer.sync
    assert not opt.param_sync.groups
    for s in opt.slices:
        assert not s.separate_master and s.master.data_ptr() == s.param.data_ptr()
        for m, p in zip(s.masters, s.pieces):
            assert m.grad is not None and m.grad.data_ptr() == p.of(s.grad).data_ptr()
    for g in sync.groups:
        for p in g.params:
            assert p.grad is None or p.grad is p.main_grad
            assert g.param_data.data_ptr() <= p.data_ptr() < g.param_data.data_ptr() + g.param_data.nbytes
            assert g.grad_data.data_ptr() <= p.main_grad.data_ptr() < g.grad_data.data_ptr() + g.grad_data.nbytes
    _, _, bf16 = run(tiny_config(**small, bf16=True))
    assert all(s.separate_master == (s.param.dtype == torch.bfloat16) for s in bf16.optimizer.slices)
    assert any(s.separate_master for s in bf16.optimizer.slices)
    line = describe_static(bf16.sync, bf16.optimizer, "bf16", bf16.config.train.optimizer_precision())
    assert "bytes per parameter" in line and "dense 18 = 2 + 4 + 12/1" in line, line
    p = OptimizerPrecision()
    assert bytes_per_parameter("bf16", p, 1) == 2 + 4 + 12 and bytes_per_parameter("bf16", p, 4) == 2 + 4 + 3
    assert bytes_per_parameter("fp32", p, 8) == 4 + 4 + 1
    half = OptimizerPrecision(main_grads_dtype="bf16", exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    assert bytes_per_parameter("bf16", half, 2) == 2 + 2 + (4 + 2 + 2) / 2
    with pytest.raises(ValueError, match="--exp-avg-dtype='fp16'; valid: fp32, bf16"):
        OptimizerPrecision(exp_avg_dtype="fp16")
    with pytest.raises(ValueError, match="--main-params-dtype='bf16'; valid: fp32"):
        tiny_config(main_params_dtype="bf16")


class _OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_norm_and_step_never_read_a_device_value_on_the_host():
    """The step's one host read is the trainer's (the norm, with the logged losses); the norm and the AdamW step
    themselves call none of the aten ops that synchronise with a CUDA device."""
    _, _, trainer = run(tiny_config(steps=1, recipe="qwen3_moe_tiny", micro_batch_size=4, global_batch_size=4,
                                    bf16=True, exp_avg_dtype="bf16"))   # the widening and casting paths too
    with _OpNames() as ops:
        norm = trainer.optimizer.grad_norm()
        trainer.optimizer.step(1e-3, 0.5)
    syncing = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.is_nonzero", "aten.equal"}
    assert ops.names and not syncing & set(ops.names), sorted(syncing & set(ops.names))
    assert norm.dim() == 0 and torch.isfinite(norm)


def test_optimizer_and_recompute_flags_reach_the_run_config():
    import argparse

    from moefold.training.cli.train import add_arguments, config_from_args
    from moefold.training.config import RunConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--recipe", "qwen3_moe_tiny", "--main-grads-dtype", "bf16", "--exp-avg-dtype", "bf16",
                              "--exp-avg-sq-dtype", "bf16", "--main-params-dtype", "fp32", "--overlap-param-gather",
                              "--recompute-granularity", "selective", "--recompute-modules", "moe_act", "layernorm",
                              "--recompute-method", "block", "--recompute-num-layers", "2"])
    config = config_from_args(args)
    t, o = config.train, config.options
    assert (t.main_grads_dtype, t.exp_avg_dtype, t.exp_avg_sq_dtype, t.overlap_param_gather) == ("bf16", "bf16",
                                                                                                "bf16", True)
    assert (o.recompute, o.recompute_modules, o.recompute_method, o.recompute_num_layers) == (
        "selective", ("moe_act", "layernorm"), "block", 2)
    assert RunConfig.from_dict(json.loads(config.to_json())) == config   # checkpoint meta round trip
    with pytest.raises(SystemExit):
        parser.parse_args(["--recipe", "qwen3_moe_tiny", "--recompute-modules", "attention"])
