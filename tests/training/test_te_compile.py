"""``--compile`` with ``--fp8-backend te --fp8-recipe delayed``: TE's calls stay out of the compiled graphs.

Transformer Engine refuses to enter an autocast with ``DelayedScaling`` while torch.compile traces
(``quantization.py`` ``check_recipe_support``, from ``autocast.__enter__``). moefold enters the autocast once
per forward in the decoder (never compiled: ``execution.compile`` compiles blocks and their children), and
its TE GEMM wrappers are ``torch.compiler.disable``d (TE's module forwards are dynamo-disabled too), so the
combination runs: this test trains it (world 1, the TE stand-in, dynamo with its ``eager`` backend so the
test measures tracing, not inductor's C++ builds) with selective recompute inside the compiled attention
and shared experts, and compares it with the same run uncompiled.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from moefold.models.options import ModelOptions
from moefold.moe.activation import fused_activation
from moefold.parallel.dims import ParallelDims
from moefold.precision.fp8 import FP8Config
from moefold.training.trainer import Trainer
from tests.moe import te_standin
from tests.training.trainer_common import tiny_config, tiny_data

FP8 = FP8Config("hybrid", "delayed", backend="te")


@pytest.fixture
def eager_dynamo(monkeypatch):
    """torch.compile with dynamo's ``eager`` backend: graphs are traced (TE's is_compiling checks see it),
    kernels are not generated."""
    compile_ = torch.compile

    def compile_eager(*args, **kwargs):
        kwargs["backend"] = "eager"
        return compile_(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", compile_eager)
    fused_activation.cache_clear()
    yield
    fused_activation.cache_clear()
    torch._dynamo.reset()


def _losses(compile: bool, recompute: str, modules: tuple[str, ...]) -> tuple[list[float], int]:
    te_standin.reset()
    counters.clear()
    config = tiny_config(steps=2, recipe="deepseek_v3_tiny", compile=compile, global_batch_size=2)
    options = ModelOptions(gemm_backend="te", fp8=FP8, recompute=recompute, recompute_modules=modules)
    trainer = Trainer(dataclasses.replace(config, options=options), ParallelDims.single(), log=lambda _m: None)
    losses: list[float] = []
    trainer.fit(tiny_data(), on_step=lambda r: losses.append(r.loss_lm))
    calls = [c["recipe"] for g in te_standin.GroupedLinear.instances for c in g.forward_calls]
    calls += [r for lin in te_standin.Linear.instances for r in lin.calls]
    assert calls and all(r == FP8.te_recipe() for r in calls), "a TE call ran outside the FP8 region"
    # one TE autocast per micro-batch forward, entered by the decoder outside every compiled graph (plus one
    # per checkpointed region replayed in backward, as TE's own checkpoint does): none is entered while
    # dynamo traces, so no graph break comes from TE's refusal
    forwards, entered = 2 * trainer.num_micro, len(te_standin._State.entered)
    assert entered == forwards if recompute == "none" else entered > forwards and entered % forwards == 0, entered
    refusals = [reason for reason in counters["graph_break"] if "DelayedScaling" in reason]
    assert not refusals, refusals
    return losses, len(calls) + 1000 * entered


def test_stand_in_refuses_delayed_scaling_autocast_while_compiling(monkeypatch, eager_dynamo):
    """The stand-in rejects what TE rejects: entering the autocast inside a compiled function."""
    pt = te_standin.install(monkeypatch)
    recipe = FP8.te_recipe()

    def enter(x):
        with pt.autocast(enabled=True, recipe=recipe):
            return x + 1

    with pytest.raises(Exception, match=r"DelayedScaling is not supported under torch\.compile"):
        torch.compile(enter, fullgraph=True)(torch.ones(2))


@pytest.mark.parametrize(("recompute", "modules"), [("none", ()),
                                                    ("selective", ("core_attn", "mla_up_proj", "shared_experts"))])
def test_compile_with_te_delayed_scaling_runs_and_equals_eager(monkeypatch, eager_dynamo, recompute, modules):
    te_standin.install(monkeypatch)
    eager, eager_calls = _losses(False, recompute, modules)
    compiled, compiled_calls = _losses(True, recompute, modules)
    assert compiled_calls == eager_calls
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), atol=1e-6, rtol=1e-6)
