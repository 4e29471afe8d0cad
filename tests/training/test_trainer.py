"""Trainer behaviour: determinism, non-finite steps, the ``moefold train`` command and its flag checks."""

from __future__ import annotations

import json

import pytest
import torch

from moefold.training.cli import main as cli_main
from moefold.training.observe.flops import train_flops_per_token
from moefold.training.trainer import NonFiniteError
from tests.training.trainer_common import run, tiny_config


def test_same_seed_same_losses_bit_identical():
    a, pa, _ = run(tiny_config(steps=2))
    b, pb, _ = run(tiny_config(steps=2))
    assert a == b and all(torch.equal(pa[k], pb[k]) for k in pa)


def test_nan_loss_skips_the_step_and_stops_after_n_in_a_row():
    messages: list[str] = []
    nan_at_step_1 = lambda step, micro, loss: loss * float("nan") if step == 1 and micro == 0 else loss
    _, p1, t1 = run(tiny_config(steps=1))
    _, p2, t2 = run(tiny_config(steps=2), hook=nan_at_step_1, log=messages.append)
    assert t2.optimizer.step_count == 1 and t2.iteration == 2
    for k in p1:   # the skipped step changed nothing (weights, expert biases)
        assert torch.equal(p1[k], p2[k]), k
    assert any(k.endswith("expert_bias") and v.abs().sum() > 0 for k, v in p1.items())  # step 1 did update it
    for k, v in t1.model.state_dict().items():
        assert torch.equal(v, t2.model.state_dict()[k]), k
    assert any("non-finite loss" in m and "skipping the optimizer step" in m for m in messages), messages
    always_nan = lambda step, micro, loss: loss * float("nan")
    with pytest.raises(NonFiniteError, match="2 steps in a row had a non-finite loss"):
        run(tiny_config(steps=4, max_skipped_steps=2), hook=always_nan)


def test_invalid_flags_fail_before_any_rank_starts(capsys, tmp_path):
    # small enough to finish quickly should a check ever let it through
    base = ["train", "--recipe", "qwen3_moe_tiny", "--nproc", "4", "--train-iters", "1", "--seq-length", "32",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--run-dir", str(tmp_path), "--device", "cpu",
            "--no-balance-report"]
    assert cli_main([*base, "--tensor-model-parallel-size", "3"]) == 2   # the valid sizes for the model
    assert "--tensor-model-parallel-size=3 does not split qwen3_moe_tiny" in capsys.readouterr().err
    assert cli_main([*base, "--pipeline-model-parallel-size", "3"]) == 2   # and for the world
    assert "the world has 4 ranks (--nproc 4): use --nproc 6" in capsys.readouterr().err
    assert cli_main([*base, "--micro-batch-size", "4", "--global-batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "--global-batch-size=8" in err and "--micro-batch-size=4" in err
    assert cli_main([*base, "--expert-model-parallel-size", "3"]) == 2
    assert "num_experts=8 is not divisible by ep=3; valid for this model" in capsys.readouterr().err
    assert cli_main([*base, "--tensor-model-parallel-size", "4", "--vocab-size", "510"]) == 2
    err = capsys.readouterr().err
    assert "vocab_size=510 is not divisible by tp=4" in err and "--tensor-model-parallel-size=4" in err
    assert cli_main([*base, "--context-parallel-size", "2", "--seq-length", "30"]) == 2
    assert "--context-parallel-size=2 does not split qwen3_moe_tiny: --seq-length=30 is not divisible by 2 x cp=2" \
        in capsys.readouterr().err


def test_moefold_train_two_ranks_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    args = ["train", "--recipe", "qwen3_moe_tiny", "--nproc", "2", "--expert-model-parallel-size", "2",
            "--train-iters", "3", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--lr-warmup-iters", "1", "--log-interval", "1", "--run-dir", str(run_dir), "--save", str(save),
            "--device", "cpu"]
    assert cli_main(args) == 0
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["tflops_per_s"] > 0 and r["moe"]["worst_layer"] is not None for r in steps)
    assert (save / "iter_0000003" / "meta.json").is_file()
    pngs = list((run_dir / "balance_report").glob("*.png"))
    assert pngs and all(p.stat().st_size > 0 for p in pngs)
    # resume from it for one more step at world 1
    assert cli_main([*args[:3], *args[7:], "--train-iters", "4", "--load", str(save)]) == 0
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["kind"] == "step"][-1] == 4


def test_flops_count_only_active_experts():
    c = tiny_config().model
    base = train_flops_per_token(c, 32)
    more_experts = train_flops_per_token(c.with_(num_experts=16), 32)
    more_topk = train_flops_per_token(c.with_(moe_topk=4), 32)
    assert base < more_topk and more_experts - base < (more_topk - base) / 10   # only the router grows with E
    assert train_flops_per_token(c, 64) > base                                  # attention grows with S


def test_public_names_resolve():
    from moefold import training

    for name in training.__all__:
        assert getattr(training, name) is not None, name
    assert training.Trainer.__module__ == "moefold.training.trainer"


def test_batches_reach_the_device_without_blocking_the_host(monkeypatch):
    """``Trainer._split`` sends each host micro-batch with ``non_blocking=True`` (HostSyncCounter counts a blocking
    host->device copy as a sync; the meta device stands in for a GPU here), and on CUDA from pinned memory (a copy
    from pageable memory blocks the host whatever ``non_blocking`` says)."""
    from types import SimpleNamespace

    from moefold.training.data.sampler import batch_to_device
    from moefold.training.observe.host_sync import HostSyncCounter
    from moefold.training.trainer import Trainer

    batch = torch.arange(2 * 9).reshape(2, 9)
    fake = SimpleNamespace(device=torch.device("meta"), dims=SimpleNamespace(cp=1, cp_rank=0), eod=None)
    with HostSyncCounter() as syncs:
        ids = Trainer._split(fake, batch)["input_ids"]
    assert ids.device.type == "meta" and tuple(ids.shape) == (2, 8) and syncs.total == 0, syncs.report()
    # packed documents (--reset-* --eod-mask-loss): planned from the loader's host ids (the counter counts those
    # reads as if the batch were on the device: they are the only ones), their tensors sent the same way
    train = SimpleNamespace(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    packed = SimpleNamespace(**{**vars(fake), "eod": 4, "config": SimpleNamespace(train=train)})
    with HostSyncCounter() as syncs:
        mb = Trainer._split(packed, batch)
    assert mb["documents"].starts == ((0, 5), (0,)) and mb["documents"].positions.device.type == "meta"
    assert mb["loss_mask"].device.type == "meta" and batch.device.type == "cpu"
    assert all("dense/documents.py" in site for site in syncs.per_site), syncs.report()
    calls = []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append((a, k)) or self)
    batch_to_device(batch, torch.device("cuda", 0))
    assert calls == ["pin", ((torch.device("cuda", 0),), {"non_blocking": True})], calls


def test_one_host_wait_per_training_step():
    """A step copies to the host once: the logged losses, the gradient norm, the expert counts and router sums in
    one ``tolist`` (the expert-bias update reads the counts on the device). A second copy after the optimizer step
    (``loads.cpu()``, as before) would make a GPU's host wait twice a step. Counted with the CPU host-sync model
    by source file: the layers' own syncs (the dispatch's split sizes, fp32 grouped_mm) are theirs, not the
    trainer's. deepseek_v3_tiny: expert bias, so the update that reads the counts runs."""
    from moefold.parallel.dims import ParallelDims
    from moefold.training.observe.host_sync import HostSyncCounter
    from moefold.training.trainer import Trainer
    from tests.training.trainer_common import tiny_data

    trainer = Trainer(tiny_config(steps=4), ParallelDims.single(), log=lambda _m: None)
    data = tiny_data()
    trainer.fit(data, stop_at=1)   # the first step's lazy set-up is not per step
    with HostSyncCounter() as syncs:
        trainer.fit(data, stop_at=3)
    layers = ("moe/", "dispatch/", "dense/", "models/")
    outside = {site: n for site, n in syncs.per_site.items() if not site.startswith(layers)}
    assert outside == {next(iter(outside)): 2} and next(iter(outside)).startswith("training/trainer.py"), (
        outside, syncs.report())


def test_a_finished_run_releases_its_model_and_optimizer(tmp_path, monkeypatch):
    """``train()`` (``moefold train`` in-process) closes its trainer: the gradient hooks on the parameters reach
    the model and the optimizer through autograd's C++ side, a cycle Python's collector cannot free, so before
    ``Trainer.close`` every finished in-process run kept everything it allocated (76 MB for this tiny run; 17 GB
    of a proxy run on the H200, which the GPU check's next row then counted as its own peak)."""
    import gc
    import weakref

    from moefold.training import trainer as trainer_module

    made = []
    original = trainer_module.Trainer.__init__

    def remember(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(weakref.ref(next(self.model.parameters())))

    monkeypatch.setattr(trainer_module.Trainer, "__init__", remember)
    rc = cli_main(["train", "--recipe", "deepseek_v3_tiny", "--train-iters", "2", "--micro-batch-size", "1",
                   "--global-batch-size", "2", "--seq-length", "32", "--vocab-size", "512", "--no-save",
                   "--no-balance-report", "--run-dir", str(tmp_path / "run"), "--log-interval", "1"])
    assert rc in (0, None), f"the run failed (exit {rc})"
    gc.collect()
    assert len(made) == 1 and made[0]() is None, "the finished run's parameters are still alive"
