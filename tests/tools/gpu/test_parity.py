"""The GPU check's correct-on-CUDA rows (``moefold.tools.gpu.parity``) on the CPU: their limits pass another fp32
summation order and catch a defect the size of a weight's rounding in bf16; a row that fails fails the command."""

from __future__ import annotations

import torch

from moefold.models.decoder import MoEDecoder
from moefold.models.recipes import get_recipe
from moefold.tools.gpu import parity


def _runs(recipe: str = "deepseek_v3_tiny"):
    config = get_recipe(recipe)
    cpu = MoEDecoder(config)
    cpu.init_weights(0)
    state = {k: v.detach().clone() for k, v in cpu.state_dict().items()}
    samples = torch.randint(0, config.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0))
    exact = parity.run(parity.build(config, state, "cpu").double(), samples)
    return config, state, samples, parity.run(cpu, samples), exact


def test_limits_pass_another_order_and_catch_a_defect():
    """The float64 run rounded to fp32 is an fp32 result of another order (the exact one): within every limit.
    One expert's weights rounded to bf16 (a relative change of ~2^-9, what a wrong cast would do) is not."""
    config, state, samples, ref, exact = _runs()
    tol = parity.fp32_tolerance(config, 2 * 64)
    assert 1e-5 < tol < 3e-5
    other = {n: g.float().double() for n, g in exact.grads.items()}
    assert parity.used(exact.logits.float().double(), ref.logits, exact.logits, tol) <= 1
    assert max(parity.used(other[n], g, exact.grads[n], tol) for n, g in ref.grads.items()) <= 1
    name = "layers.1.mlp.experts.w13"
    broken = dict(state, **{name: state[name].bfloat16().float()})
    bad = parity.run(parity.build(config, broken, "cpu"), samples)
    assert parity.used(bad.logits, ref.logits, exact.logits, tol) > 1
    assert parity.used(bad.grads[name], ref.grads[name], exact.grads[name], tol) > 1


def test_a_device_model_that_differs_fails_its_row_and_the_command(monkeypatch, capsys):
    """check_model builds: the float64 copy, the device model, then the bf16 pair; the device model with one
    weight off by its bf16 rounding makes the fp32 row "failed", the others still print, and the exit code is 1."""
    real_build, calls = parity.build, []

    def build(config, state, device, dtype="fp32"):
        calls.append(dtype)
        if len(calls) == 2:   # the "device" model
            name = "layers.0.self_attn.q_proj.weight"
            state = dict(state, **{name: state[name].bfloat16().float()})
        return real_build(config, state, device, dtype)

    monkeypatch.setattr(parity, "build", build)
    assert parity.main(["--device", "cpu", "--models", "qwen3_moe_tiny"]) == 1
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| qwen3_moe_tiny")]
    assert len(rows) == 2 and "| failed: " in rows[0] and rows[1].endswith("| passed |"), rows
