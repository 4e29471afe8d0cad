"""Optimizer offload (``--optimizer-cpu-offload --optimizer-offload-fraction F``, ``training.optim.offload``).

- Updates equal the on-device ones, bit for bit on the CPU: 3 steps of the trainer with F = 0, 0.5 and 1 give the
  same losses, parameters (expert biases included) and optimizer states as no offload, at world 1 (fp32 and bf16
  with an fp32 master) and at dp2 (ZeRO-1 shards: the deferred parameter all-gathers), in one 2-rank world.
- The fraction is honoured: the host holds F of the owned elements (to one bucket), the device the rest, and
  the start-up accounting moves those bytes from "optimizer" to "host_optimizer".
- The CPU update runs while the next step starts: ``step()`` returns with the worker still busy (held on purpose),
  the next forward waits in the first module that reads an offloaded bucket, and the values are still right.
- Resume: a checkpoint saved with offload loads without it (and back) to the same parameters and states.
"""

from __future__ import annotations

import threading

import pytest
import torch

from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.observe.memory import static_bytes
from moefold.training.optim import offload as offload_module
from tests.distributed import run_distributed
from tests.training.trainer_common import run, tiny_config

STEPS = 3
FRACTIONS = (0.0, 0.5, 1.0)


def _states(trainer) -> dict[str, torch.Tensor]:
    out = {}
    for key, pieces in trainer.optimizer.checkpoint_state().items():
        for offsets, _, t in pieces.boxes:
            out[f"{key}@{tuple(offsets)}"] = t.detach().clone()
    return out


def _runs(parallel: ParallelConfig, dims: ParallelDims | None = None, **train) -> dict:
    out = {}
    for fraction in (None, *FRACTIONS):
        extra = {} if fraction is None else {"optimizer_cpu_offload": True, "optimizer_offload_fraction": fraction}
        config = tiny_config(parallel, steps=STEPS, bucket_numel=2048, **train, **extra)
        losses, params, trainer = run(config, dims)
        out[fraction] = (losses, params, _states(trainer), static_bytes(trainer.sync, trainer.optimizer),
                         sum(s.param.numel() for s in trainer.optimizer.slices if s.offloaded),
                         sum(s.param.numel() for s in trainer.optimizer.slices),
                         max(s.param.numel() for s in trainer.optimizer.slices))
        trainer.optimizer.host.close()
    return out


def _check(results: dict) -> None:
    losses, params, states, static, _, _, _ = results[None]
    for fraction in FRACTIONS:
        got_losses, got_params, got_states, got_static, host_numel, total_numel, bucket = results[fraction]
        assert got_losses == losses, fraction
        assert got_params.keys() == params.keys()
        for name, value in got_params.items():
            assert torch.equal(value, params[name]), (fraction, name)
        assert got_states.keys() == states.keys()
        for key, value in got_states.items():
            assert torch.equal(value, states[key]), (fraction, key)
        assert fraction * total_numel <= host_numel < fraction * total_numel + bucket   # whole buckets
        moved = got_static["host_optimizer"] > 0
        assert moved == (host_numel > 0)
        assert got_static["optimizer"] < static["optimizer"] or host_numel == 0
        assert got_static["params"] == static["params"] and got_static["grads"] == static["grads"]
    assert results[1.0][3]["optimizer"] == 0


@pytest.mark.parametrize("bf16", [False, True])
def test_updates_equal_on_device_world1(bf16: bool) -> None:
    _check(_runs(ParallelConfig(), bf16=bf16))


def _dp2() -> dict:
    return _runs(ParallelConfig(), ParallelDims.build(ParallelConfig()))


def test_updates_equal_on_device_dp2() -> None:
    for results in run_distributed(_dp2, 2, timeout=300):
        _check(results)


def test_next_step_starts_while_the_cpu_updates(monkeypatch) -> None:
    release, started = threading.Event(), threading.Event()
    original = offload_module.HostOptimizer._run

    def held(self, *args):
        started.set()
        assert release.wait(60)
        return original(self, *args)

    monkeypatch.setattr(offload_module.HostOptimizer, "_run", held)
    config = tiny_config(steps=2, bucket_numel=2048, optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)
    waited = []

    def setup(trainer):
        wait = trainer.optimizer.host.wait

        def recording_wait():
            waited.append(trainer.optimizer.host.pending)
            if trainer.optimizer.host.pending:
                release.set()   # the forward reached an offloaded bucket while the worker was held
            wait()
        trainer.optimizer.host.wait = recording_wait
        trainer.optimizer.param_sync._wait_deferred = recording_wait
        original_step = trainer.optimizer.step

        def step(*args, **kwargs):
            original_step(*args, **kwargs)
            assert started.wait(60) and trainer.optimizer.host.pending   # returned, the CPU update still running
        trainer.optimizer.step = step

    losses, params, _ = run(config, setup=setup)
    assert waited[0] is True   # the first wait found the update still running
    release.set()
    reference_losses, reference_params, _ = run(tiny_config(steps=2, bucket_numel=2048))
    assert losses == reference_losses
    for name, value in params.items():
        assert torch.equal(value, reference_params[name]), name


def test_resume_across_offload(tmp_path) -> None:
    base = {"bucket_numel": 2048}
    offload = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}
    _, full, _ = run(tiny_config(steps=4, **base))
    run(tiny_config(steps=4, save=str(tmp_path / "a"), **base, **offload), stop_at=2)
    _, resumed, _ = run(tiny_config(steps=4, **base), load=str(tmp_path / "a"))
    for name, value in resumed.items():
        assert torch.equal(value, full[name]), name
    run(tiny_config(steps=4, save=str(tmp_path / "b"), **base), stop_at=2)
    _, resumed, _ = run(tiny_config(steps=4, **base, **offload), load=str(tmp_path / "b"))
    for name, value in resumed.items():
        assert torch.equal(value, full[name]), name
