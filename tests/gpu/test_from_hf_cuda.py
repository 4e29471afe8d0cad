"""Starting from HF weights, validation, upcycling and generation on one CUDA GPU equal the same on CPU (the
weights are read on the host and copied into the device's parameters; generation samples from a CPU generator).
Skipped without CUDA (tests/gpu/conftest.py); in a rehearsal (tests/gpu/rehearsal.py) the "GPU" side is a second
CPU run, compared the same way."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from moefold.models.generate import generate
from moefold.parallel.dims import ParallelDims
from moefold.training.checkpoint.load_model import load_model
from moefold.training.data.indexed import IndexedDatasetWriter
from moefold.training.evaluate import evaluate
from moefold.training.run import build_dataset
from moefold.training.trainer import Trainer
from tests.models.hf_tiny import VOCAB, hf_dense_model, save_hf, tokens
from tests.training.trainer_common import fit_results, tiny_config

pytest.importorskip("transformers")


def test_generate_on_cuda_equals_cpu(tmp_path, device):
    save_hf("mixtral", tmp_path)
    ids = tokens(batch=2, seq=5, seed=3)
    outs = {}
    for where in ("cpu", device):
        model, _ = load_model(tmp_path, device=where)
        assert next(model.parameters()).device.type == where
        outs[where] = [generate(model, ids, 12).cpu(),
                       generate(model, ids, 12, temperature=0.9, top_p=0.9, seed=4).cpu()]
    for a, b in zip(outs["cpu"], outs[device]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("upcycle", [False, True])
def test_load_hf_and_validation_on_cuda_equal_cpu(tmp_path, upcycle, device):
    if upcycle:
        hf_dense_model("qwen3").save_pretrained(tmp_path / "hf")
    else:
        save_hf("qwen3_moe", tmp_path / "hf")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "data", VOCAB) as writer:
        for _ in range(40):
            writer.add_document(rng.integers(1, VOCAB, size=30))
    from moefold.models.pretrained import pretrained_config
    from moefold.models.upcycle import upcycled_config

    model = pretrained_config(tmp_path / "hf")
    if upcycle:
        model = upcycled_config(model, 4, 2, 24)
    config = tiny_config(steps=2)
    config = dataclasses.replace(config, model=model, train=dataclasses.replace(
        config.train, seq_length=16, load_hf=str(tmp_path / "hf"), moe_use_upcycling=upcycle,
        data_path=(str(tmp_path / "data"),), split="90,10,0", eval_iters=2))
    losses = []
    for where in ("cpu", device):
        dims = ParallelDims.single(where)
        trainer = Trainer(config, dims, device=where, log=lambda _m: None)
        valid = build_dataset(config, dims, part="valid")
        before = evaluate(trainer, valid, 2).loss_lm
        steps = [r.loss_lm for r in fit_results(trainer, build_dataset(config, dims))]
        losses.append([before, *steps, evaluate(trainer, valid, 2).loss_lm])
    np.testing.assert_allclose(losses[1], losses[0], atol=1e-4, rtol=0)
