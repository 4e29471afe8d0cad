"""Nemotron-H (issue 51) at parallel layouts, in ONE 4-rank world: logits of a tiny random ``NemotronHForCausalLM``
checkpoint equal transformers' at ep2, ep4 (experts folded over dp) and pp2 (Mamba-2, attention and MoE layers on
both stages), and the loss and every gradient equal world 1's at ep2 (x dp2) and ep4. tp and cp are refused at
start-up for the Mamba-2 layers (tests/models/test_nemotron_h.py): the mixer is not split."""

from __future__ import annotations

import pytest
import torch

from moefold.models.options import ModelOptions
from moefold.parallel.dims import ParallelConfig, ParallelDims
from tests.distributed import run_distributed
from tests.models.hf_tiny import hf_logits, tokens
from tests.models.nemotron_h_tiny import hf_model
from tests.tolerance import assert_within_fp32_noise

pytest.importorskip("transformers")

TOL = 1e-5
LOGIT_LAYOUTS = [("ep2", dict(ep=2)), ("ep4", dict(ep=4)), ("pp2", dict(pp=2)), ("pp2xep2", dict(pp=2, ep=2))]
GRAD_LAYOUTS = [("ep2", dict(ep=2)), ("ep4", dict(ep=4))]


def _rank(path: str, ref: torch.Tensor, ids: torch.Tensor):
    from tests.models.test_families_parallel import _grads, _logits, _reference_grads

    report = {}
    for label, par in LOGIT_LAYOUTS:
        logits = _logits(path, ParallelDims.build(ParallelConfig(**par)), ModelOptions(), ids)
        if logits is not None:
            report[label] = (logits - ref).abs().max().item()
            assert report[label] <= TOL, (label, report[label])
    ref_losses, mb_grads, mb_grads64 = _reference_grads(path, 4)
    for label, par in GRAD_LAYOUTS:
        dims = ParallelDims.build(ParallelConfig(**par))
        total, grads = _grads(path, dims, ModelOptions())
        torch.testing.assert_close(total, ref_losses[dims.dp_rank], atol=1e-6, rtol=1e-6)
        ref_g, ref64 = ({n: sum(mb[r][n] for r in range(dims.dp)) / dims.dp for n in mb[0]}
                        for mb in (mb_grads, mb_grads64))
        report[f"grads {label}"] = assert_within_fp32_noise(grads, ref_g, ref64, f"nemotron_h {label}")
    return report


def test_nemotron_h_layouts_equal_transformers_and_world1(tmp_path):
    hf = hf_model(2)   # pattern M*EM-E: both pp2 stages hold a Mamba-2 layer and an MoE layer
    hf.save_pretrained(tmp_path)
    ids = tokens(seq=16)
    reports = run_distributed(_rank, 4, str(tmp_path), hf_logits(hf, ids), ids, timeout=600)
    merged: dict[str, float] = {}
    for r in reports:
        for k, v in r.items():
            merged[k] = max(merged.get(k, 0.0), v)
    for k, v in sorted(merged.items()):
        print(f"nemotron_h {k}: max |diff| = {v:.3g}")
    assert {label for label, _ in LOGIT_LAYOUTS} <= set(merged)
