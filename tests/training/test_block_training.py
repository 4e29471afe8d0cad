"""Block-scaled recipes train like bf16: Qwen3-MoE tiny, 100 steps on 8 memorisable sequences (as
tests/training/test_fp8_training.py), every linear but the head and the expert GEMMs in the recipe, bf16
parameters with fp32 masters. Band against the bf16 run at every step: 0.15 for the FP8 recipes (blockwise,
MXFP8), 0.4 for NVFP4 (4-bit values: its per-GEMM error is ~4x FP8's); the mean of the last 10 steps within
10% / 25%. The measured gaps are printed (``pytest -s``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moefold.models.options import ModelOptions
from moefold.precision.fp8 import FP8Config
from tests.training.trainer_common import run, tiny_config, tiny_data

CASES = [("blockwise", FP8Config("e4m3", "blockwise"), 0.15, 0.10), ("mxfp8", FP8Config("e4m3", "mxfp8"), 0.15, 0.10),
         ("nvfp4", FP8Config(fp4="e2m1", router_padding=True), 0.4, 0.25)]




def _config(fp8: FP8Config):
    config = tiny_config(steps=100, recipe="qwen3_moe_tiny", global_batch_size=2, micro_batch_size=2,
                         lr_warmup_iters=10, lr_warmup_skip_zero=True, bf16=True)   # the bands' warmup
    return dataclasses.replace(config, options=ModelOptions(fp8=fp8))


def test_block_recipes_train_like_bf16(one_thread):
    data = np.tile(tiny_data(8), (30, 1))
    ref = np.array(run(_config(FP8Config()), data=data)[0])
    assert ref[-10:].mean() < 0.5, "the reference did not learn: the comparison would say nothing"
    for name, fp8, band, last10 in CASES:
        got = np.array(run(_config(fp8), data=data)[0])
        gap = np.abs(got - ref)
        print(f"{name}: bf16 {ref[0]:.3f} -> {ref[-10:].mean():.3f}, {name} -> {got[-10:].mean():.3f}; max gap "
              f"{gap.max():.3f} at step {gap.argmax() + 1}")
        assert gap.max() <= band, (name, gap.argmax() + 1, got[gap.argmax()], ref[gap.argmax()])
        assert abs(got[-10:].mean() - ref[-10:].mean()) <= last10 * ref[-10:].mean(), name
