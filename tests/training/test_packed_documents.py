"""Packed documents through ``moefold train``'s path: the flags reach the data section, the trainer refuses them
without an end-of-document token, they change the run (documents reach the model: attention, positions, loss mask),
and a 2-step run with all three equals world 1 at pp2 x dp2 (1F1B, stages joined by point-to-point), cp2 x dp2
(p2p ring) and tp2 x cp2 (all-gather), in ONE 4-rank world; the data's sample order is the trainer's usual one."""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest

from moefold.models.options import ModelOptions
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.training.cli.train import add_arguments, config_from_args
from moefold.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.training.trainer_common import SEQ, run, tiny_config

EOD = 0
DOCS = {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True}
MODEL = {"mtp_num_layers": 2}   # deepseek_v3_tiny's MLA, MoE and MTP (its depths predict inside documents)


def packed_data(num_samples: int = 32) -> np.ndarray:
    """Samples of learnable documents (a repeated pattern each) of 3 to 17 tokens, each ended by ``EOD``."""
    rng = np.random.default_rng(1)
    out = np.empty((num_samples, SEQ + 1), dtype=np.int64)
    for i in range(num_samples):
        row: list[int] = []
        while len(row) < SEQ + 1:
            pattern = rng.integers(1, 256, size=rng.integers(2, 5))
            row += [*np.resize(pattern, rng.integers(3, 17)).tolist(), EOD]
        out[i] = row[:SEQ + 1]
    return out


def test_flags_reach_the_data_section_and_need_an_eod():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    data = config_from_args(parser.parse_args(["--recipe", "mixtral_tiny", "--reset-position-ids",
                                               "--reset-attention-mask", "--eod-mask-loss"])).train.data
    assert data.reset_position_ids and data.reset_attention_mask and data.eod_mask_loss and data.packs_documents
    plain = config_from_args(parser.parse_args(["--recipe", "mixtral_tiny"])).train.data
    assert not plain.packs_documents
    with pytest.raises(ValueError, match="end-of-document token: give the Trainer its id"):
        Trainer(tiny_config(steps=1, **DOCS), ParallelDims.single())


def test_the_eod_is_the_run_tokenizers_separator(tmp_path):
    from moefold.training.data import tokenizer_path, train_bpe
    from moefold.training.run import document_eod

    prefix = tmp_path / "corpus"
    tok = train_bpe(["a packed sample", "of documents"], 260)
    tok.add_special_tokens(["</s>"])
    tok.save(str(tokenizer_path(prefix)))
    config = tiny_config(steps=1, data_path=(str(prefix),), **DOCS)
    assert document_eod(config) == tok.token_to_id("<|endoftext|>") == 0   # the first separator it defines
    assert document_eod(tiny_config(steps=1, data_path=(str(prefix),))) is None
    with pytest.raises(ValueError, match="end-of-document token: give --tokenizer-type, or a --data-path prepared"):
        document_eod(tiny_config(steps=1, data_path=(str(tmp_path / "none"),), **DOCS))


def test_validation_reads_the_documents():
    """``evaluate`` runs the micro-batches the trainer makes: with documents and the EOD loss mask."""
    import torch

    from moefold.dense.documents import packed_documents
    from moefold.training.evaluate import evaluate

    trainer = Trainer(tiny_config(steps=1, model=MODEL, **DOCS), ParallelDims.single(), eod_token=EOD,
                      log=lambda _m: None)
    data = packed_data(4)
    expected = []
    for row in torch.from_numpy(data):
        ids, labels = row[None, :-1], row[None, 1:]
        docs = packed_documents(ids, EOD, reset_position_ids=True, reset_attention_mask=True)
        expected.append(trainer.model(ids, labels, (ids != EOD).float(), documents=docs).lm_loss.item())
    assert abs(evaluate(trainer, data, 1).loss_lm - sum(expected) / 4) <= 1e-6


def _losses(parallel: ParallelConfig, dims: ParallelDims | None, eod: int | None, options: ModelOptions | None = None,
            **train) -> list[float]:
    config = tiny_config(parallel, steps=2, model=MODEL, **train)
    config = dataclasses.replace(config, options=options or ModelOptions())
    losses, _, _ = run(config, dims, data=packed_data(), eod=eod)
    return losses


def _rank() -> dict[str, list[float]]:
    reference = _losses(ParallelConfig(), ParallelDims.single(), EOD, **DOCS)
    plain = _losses(ParallelConfig(), ParallelDims.single(), None)
    out = {"world1": reference, "plain": plain}
    for label, parallel, options in (("pp2.dp2", ParallelConfig(pp=2), ModelOptions()),
                                     ("cp2.dp2", ParallelConfig(cp=2), ModelOptions()),
                                     ("tp2.cp2", ParallelConfig(tp=2, cp=2), ModelOptions(cp_comm="all_gather"))):
        dims = ParallelDims.build(parallel)
        out[label] = _losses(parallel, dims, EOD, options, **DOCS)
        assert np.allclose(out[label], reference, rtol=0, atol=2e-5), (label, out[label], reference)
    return out


def test_layouts_equal_world1():
    result = run_distributed(_rank, 4, timeout=600.0)[0]
    assert not np.allclose(result["plain"], result["world1"], atol=1e-3), result   # the flags do change the run
