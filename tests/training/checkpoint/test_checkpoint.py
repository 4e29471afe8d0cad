"""Checkpoints: exact resume, resume at other layouts (tp2 x ep2 -> ep4, pp2 x ep2, world 1; pp2 x tp2 -> world 1;
world 1 -> pp2 x dp2), half-written directories, incompatible models, keep-last-N. Damaged checkpoints and failing
saves: tests/training/checkpoint/test_integrity.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.checkpoint.files import complete_checkpoints
from tests.distributed import run_distributed
from tests.training.trainer_common import run, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4  # across layouts (fp32); the same layout must be bit-identical


def _reference(tmp_path: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses, params, _ = run(tiny_config())
    return losses, params


def test_resume_is_bit_identical_and_half_written_dirs_are_ignored(tmp_path):
    ref_losses, ref_params = _reference(tmp_path)
    save = str(tmp_path / "ckpt")
    first, _, _ = run(tiny_config(save=save), stop_at=3)
    assert first == ref_losses[:3]
    assert [d.name for d in complete_checkpoints(save)] == ["iter_0000003"]
    # a crash while writing step 4's checkpoint, and an empty directory named like a checkpoint
    (Path(save) / ".tmp-iter_0000004").mkdir()
    (Path(save) / ".tmp-iter_0000004" / "__0_0.distcp").write_bytes(b"partial")
    (Path(save) / "iter_0000005").mkdir()
    messages: list[str] = []
    rest, params, trainer = run(tiny_config(), load=save, log=messages.append)
    assert trainer.iteration == 5 and trainer.consumed_samples == 5 * 4
    assert rest == ref_losses[3:], (rest, ref_losses)          # bit-identical
    for k, v in ref_params.items():
        assert torch.equal(params[k], v), k
    text = "\n".join(messages)
    assert "ignoring half-written checkpoint" in text and ".tmp-iter_0000004" in text, text
    # a directory newer than the tracker (latest_checkpointed_iteration.txt names 3) is not a candidate at all
    assert "iter_0000005: newer than the iteration 3" in text, text
    assert "resumed from" in text and "iter_0000003" in text, text


def _cross_layout(save_a: str, save_b: str, save_w1: str) -> dict[str, list[float]]:
    out = {}
    pc = ParallelConfig(pp=2)   # a world-1 checkpoint split over two pipeline stages
    out["pp2.dp2 from world 1"] = run(tiny_config(pc), ParallelDims.build(pc), load=save_w1)[0]
    pc = ParallelConfig(tp=2, ep=2)
    run(tiny_config(pc, save=save_a), ParallelDims.build(pc), stop_at=3)
    for name, pc in (("ep4", ParallelConfig(ep=4)), ("pp2xep2", ParallelConfig(pp=2, ep=2))):
        out[name] = run(tiny_config(pc), ParallelDims.build(pc), load=save_a)[0]
    pc = ParallelConfig(pp=2, tp=2)   # a pipeline checkpoint (the embedding lives on both stages with MTP)
    run(tiny_config(pc, save=save_b), ParallelDims.build(pc), stop_at=3)
    return out


def test_resume_at_other_layouts(tmp_path):
    ref_losses, ref_params = _reference(tmp_path)
    save_a, save_b, save_w1 = str(tmp_path / "tp2ep2"), str(tmp_path / "pp2tp2"), str(tmp_path / "world1")
    run(tiny_config(save=save_w1), stop_at=3)
    results = run_distributed(_cross_layout, 4, save_a, save_b, save_w1, timeout=300)[0]
    results["world 1 from tp2 x ep2"], params_a, _ = run(tiny_config(), load=save_a)
    results["world 1 from pp2 x tp2"], params_b, _ = run(tiny_config(), load=save_b)
    for name, losses in results.items():
        assert len(losses) == 2
        diff = max(abs(a - b) for a, b in zip(losses, ref_losses[3:]))
        assert diff <= TOL, (name, losses, ref_losses[3:])
    for params in (params_a, params_b):
        for k, v in ref_params.items():
            assert (params[k] - v).abs().max().item() <= TOL, k


def test_incompatible_model_names_the_field_and_the_tensor(tmp_path):
    save = str(tmp_path / "ckpt")
    run(tiny_config(save=save), stop_at=1)
    config = tiny_config()
    wider = config.model.with_(moe_ffn_hidden_size=2 * config.model.moe_ffn_hidden_size)
    import dataclasses

    # the stored model config names the field; the tensor shapes (what a checkpoint without a config has) the tensor
    with pytest.raises(ValueError, match=r"the model differs from the checkpoint's: moe_ffn_hidden_size 64 "
                                         r"\(checkpoint: 32\)"):
        run(dataclasses.replace(config, model=wider), load=save)
    from moefold.models.decoder import MoEDecoder
    from moefold.training.checkpoint.sharded import build_state, check_compatible

    dims = ParallelDims.single()
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.1\.mlp\.experts\.\w+' has shape \([\d, ]+\) "
                                         r"but this model expects"):
        check_compatible(Path(save) / "iter_0000001", build_state(MoEDecoder(wider, dims), dims, None))


def test_keep_last_and_atomic_names(tmp_path):
    save = tmp_path / "ckpt"
    run(tiny_config(save=str(save), save_interval=1, keep_last=2), stop_at=3)
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt"]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "3\n"   # Megatron's tracker format
