"""Packed documents through the whole decoder (``--reset-position-ids --reset-attention-mask --eod-mask-loss``):

- world 1: a packed batch (two samples of 3 and 4 documents) equals each document run alone, logits, loss and
  every parameter's gradient, for sliding window + sinks + GQA (gpt_oss), MLA (deepseek_v3) and Gated DeltaNet
  (qwen3_next); without documents the logits differ (the test sees attention across documents); MTP's depths
  predict inside documents only (each depth's loss);
- in ONE 4-rank world: tp2 (SP), cp2 (p2p ring and all-gather), tp2 x cp2, cp4 and pp2 equal world 1's packed
  batch (logits; loss and reduced gradients except pp2, whose stages are joined by point-to-point here).
"""

from __future__ import annotations

import dataclasses

import torch

from moefold.execution import build_decoder
from moefold.models.decoder import MoEDecoder
from moefold.models.options import ModelOptions
from moefold.parallel.comm import gather_along_dim
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import gather_full, shards_of
from moefold.pipeline.decoder_stage import build_stage_model
from moefold.pipeline.p2p import TensorSpec, recv_forward, send_forward
from moefold.pipeline.stages import StageLayout
from moefold.training.optim.grad_sync import GradSync
from tests.distributed import run_distributed
from tests.models.documents_common import FAMILIES, LENGTHS, config, inputs, one_by_one, packed_tokens
from tests.tolerance import EPS32, assert_within_fp32_noise


def _world1(name: str, dtype: torch.dtype = torch.float32):
    """World 1's packed batch: (logits, loss, {name: gradient}) and the model."""
    model = MoEDecoder(config(name), ParallelDims.single())
    model.init_weights(7)
    model = model.to(dtype)
    ids, labels, mask, docs = inputs(packed_tokens())
    logits = model.logits(ids, documents=docs)
    out = model(ids, labels, mask, documents=docs)
    out.loss.backward()
    return logits, out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, model


def test_packed_batch_equals_each_document_alone():
    for name in FAMILIES:
        logits, loss, grads, model = _world1(name)
        model.zero_grad()
        ref_logits, ref_loss = one_by_one(model, packed_tokens())
        ref_loss.backward()
        scale = ref_logits.abs().max().item()
        assert (logits - ref_logits).abs().max().item() <= 16 * EPS32 * scale, name
        assert abs(loss.item() - ref_loss.item()) <= 16 * EPS32 * ref_loss.item(), name
        ids = inputs(packed_tokens())[0]
        assert (model.logits(ids) - ref_logits).abs().max().item() > 1e-3, name   # documents do matter
        for n, p in model.named_parameters():
            if n in grads:
                limit = 64 * EPS32 * max(p.grad.abs().max().item(), 1e-30)
                assert (grads[n] - p.grad).abs().max().item() <= limit, (name, n)


def test_mtp_predictions_stay_inside_documents():
    """DeepSeek-V3's MTP (2 depths): a token k on in the next document is what lies past a lone document's end
    (no input, no loss): each depth's packed mean equals the documents' own, weighted by their tokens."""
    cfg = config("deepseek_v3_tiny").with_(mtp_num_layers=2)
    model = MoEDecoder(cfg, ParallelDims.single())
    model.init_weights(7)
    tokens = packed_tokens()
    ids, labels, mask, docs = inputs(tokens)
    packed = model(ids, labels, mask, documents=docs).losses
    sums, counts = [0.0, 0.0], [0.0, 0.0]
    for b, lengths in enumerate(LENGTHS):
        start = 0
        for n in lengths:
            rows = slice(start, start + n)
            alone = model(ids[b:b + 1, rows], labels[b:b + 1, rows], mask[b:b + 1, rows]).losses
            for k in (1, 2):
                c = mask[b, start + k:start + n].sum().item()
                sums[k - 1] += alone[f"mtp_{k}"].item() * c
                counts[k - 1] += c
            start += n
    for k in (1, 2):
        assert abs(packed[f"mtp_{k}"].item() - sums[k - 1] / counts[k - 1]) <= 64 * EPS32 * packed[f"mtp_{k}"].item()
    crossing = model(ids, labels, mask, documents=dataclasses.replace(docs, isolate=False)).losses   # the test sees it
    assert abs(crossing["mtp_1"].item() - packed["mtp_1"].item()) > 1e-4


LAYOUTS = {   # label -> (ParallelConfig kwargs, ModelOptions kwargs, families)
    "tp2 sp": (dict(tp=2), {}, tuple(FAMILIES)),
    "cp2 p2p": (dict(cp=2), {}, tuple(FAMILIES)),
    "cp2 all_gather": (dict(cp=2), dict(cp_comm="all_gather"), tuple(FAMILIES)),
    "tp2 cp2": (dict(tp=2, cp=2), {}, ("gpt_oss_tiny", "deepseek_v3_tiny")),   # DeltaNet's 2 key heads: not both
    "cp4": (dict(cp=4), {}, ("gpt_oss_tiny",)),
}


def _pipelined_logits(name: str, dims: ParallelDims) -> torch.Tensor | None:
    """pp2: the stages' layers joined by point-to-point; full logits on the last stage, None elsewhere."""
    cfg = config(name)
    model = build_stage_model(cfg, dims, ModelOptions(), StageLayout(cfg.num_layers, dims.pp))
    model.init_weights(7)
    ids, _, _, docs = inputs(packed_tokens())
    positions = model.position_ids(ids.shape[1], ids.device)
    hidden = model.embed(ids) if dims.pp_rank == 0 else None
    if dims.pp_rank > 0:
        hidden, handle = recv_forward(TensorSpec((ids.shape[1], ids.shape[0], cfg.hidden_size)), dims.pp_group)
        handle.wait()
    hidden, _ = model.run_layers(hidden, positions, documents=docs)
    if dims.pp_rank < dims.pp - 1:
        send_forward(hidden, dims.pp_group).wait()
        return None
    return gather_along_dim(model.head_logits(hidden).float(), dims.tp_group, dim=-1).transpose(0, 1)


def _rank() -> dict[str, float]:
    refs = {name: _world1(name) for name in FAMILIES}
    refs64 = {name: _world1(name, torch.float64)[2] for name in FAMILIES}
    report = {}
    for label, (par, opts, families) in LAYOUTS.items():
        dims = ParallelDims.build(ParallelConfig(**par))
        for name in families:
            ref_logits, ref_loss, ref_grads, _ = refs[name]
            model = build_decoder(config(name), dims, ModelOptions(**opts))
            model.init_weights(7)
            ids, labels, mask, docs = inputs(packed_tokens(), dims.cp_rank, dims.cp)
            diff = (model.logits(ids, documents=docs) - ref_logits).abs().max().item()
            assert diff <= 16 * EPS32 * ref_logits.abs().max().item(), (label, name, diff)
            sync = GradSync(model.named_parameters(), dims)
            sync.start_step(1)
            out = model(ids, labels, mask, documents=docs)   # every dp rank: the same batch, so the mean is it
            out.loss.backward()
            sync.finish()
            assert abs(out.lm_loss.item() - ref_loss.item()) <= 16 * EPS32 * ref_loss.item(), (label, name)
            params = dict(model.named_parameters())
            grads = {n: gather_full(g, shards_of(params[n])) for n, g in sync.gathered_grads().items()}
            grads = {n: g for n, g in grads.items() if n in ref_grads}
            report[f"{name} {label}"] = assert_within_fp32_noise(
                grads, {n: ref_grads[n] for n in grads}, {n: refs64[name][n] for n in grads}, f"{name} {label}")
    dims = ParallelDims.build(ParallelConfig(pp=2))
    for name in FAMILIES:
        logits = _pipelined_logits(name, dims)
        if logits is not None:
            ref_logits = refs[name][0]
            diff = (logits - ref_logits).abs().max().item()
            assert diff <= 16 * EPS32 * ref_logits.abs().max().item(), ("pp2", name, diff)
            report[f"{name} pp2 logits"] = diff
    return report


def test_layouts_equal_world1():
    reports = run_distributed(_rank, 4, timeout=600.0)
    assert any("pp2" in k for k in reports[-1]), reports[-1]
