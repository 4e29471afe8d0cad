"""Decoder structure at world 1: layer kinds, stable names across pipeline stages, the pipelining
pieces compose to the whole forward, tied embeddings, global aux-loss state, bad input."""

from __future__ import annotations

import pytest
import torch

from moefold.dense.mlp import DenseMLP
from moefold.models.decoder import MoEDecoder
from moefold.models.options import ModelOptions
from moefold.models.recipes import deepseek_v3_tiny, mixtral_tiny, qwen3_moe_tiny
from moefold.moe.layer import MoELayer


def _batch(vocab: int, B: int = 2, S: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, S), generator=g), torch.randint(0, vocab, (B, S), generator=g)


def test_layer_kinds_and_patterns():
    ds = MoEDecoder(deepseek_v3_tiny())  # first_k_dense_replace=1, MTP 1
    assert isinstance(ds.layers["0"].mlp, DenseMLP) and isinstance(ds.layers["1"].mlp, MoELayer)
    assert len(ds.mtp) == 1 and isinstance(ds.mtp[0].block.mlp, MoELayer)
    cfg = qwen3_moe_tiny().with_(num_layers=4, moe_layer_freq=(1, 0, 0, 1), ffn_hidden_size=48)
    kinds = [type(layer.mlp) for layer in MoEDecoder(cfg).layers.values()]
    assert kinds == [MoELayer, DenseMLP, DenseMLP, MoELayer]
    assert [MoEDecoder(qwen3_moe_tiny().with_(num_layers=4, moe_layer_freq=2, ffn_hidden_size=48)).config
            .is_moe_layer(i) for i in range(4)] == [True, False, True, False]


def test_stage_names_and_pieces_compose():
    cfg = deepseek_v3_tiny()
    model = MoEDecoder(cfg)
    model.init_weights(1)
    stage = MoEDecoder(cfg, layer_ids=[1, 2], with_embedding=False, with_head=False)
    stage.init_weights(1)
    whole = dict(model.named_parameters())
    for name, p in stage.named_parameters():  # same names, same layout-independent init
        assert torch.equal(p, whole[name]), name
    ids, labels = _batch(cfg.vocab_size)
    out = model(ids, labels)
    pos = torch.arange(ids.shape[1])
    h = model.embed(ids)
    h, infos0 = model.run_layers(h, pos, [0])
    h, infos1 = model.run_layers(h, pos, [1, 2])
    loss, logs, mtp_infos = model.head_loss(h, labels, None, ids, pos)
    aux = sum(i.aux_loss for i in {**infos0, **infos1, **mtp_infos}.values())
    torch.testing.assert_close(loss + aux, out.loss)
    assert set(out.moe) == {1, 2, 3} and out.num_tokens == ids.numel()
    torch.testing.assert_close(out.lm_loss, logs["lm"])


def test_tied_embeddings_and_bf16():
    cfg = mixtral_tiny().with_(tie_word_embeddings=True)
    model = MoEDecoder(cfg, options=ModelOptions(dtype="bf16"))
    names = [n for n, _ in model.named_parameters()]
    assert "embed_tokens.weight" in names and not any(n.startswith("output_head") for n in names)
    ids, labels = _batch(cfg.vocab_size)
    out = model(ids, labels)
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.embed_tokens.weight.grad is not None
    assert model.logits(ids).shape == (2, 8, cfg.vocab_size)


def test_global_aux_loss_state_passes_between_micro_batches():
    cfg = qwen3_moe_tiny()  # global_aux_loss
    model = MoEDecoder(cfg)
    ids, labels = _batch(cfg.vocab_size)
    first = model(ids, labels)
    assert sorted(first.global_states) == [0, 1]
    second = model(ids, labels, global_states=first.global_states)
    assert all(s.num_micro_batches == 2 for s in second.global_states.values())
    assert "moe/global_aux_loss" in first.losses


def test_ignore_index_counts_as_masked():
    model = MoEDecoder(mixtral_tiny())
    ids, labels = _batch(512)
    mask = torch.ones(2, 8)
    mask[:, -3:] = 0
    masked = model(ids, labels, mask)
    ignored = model(ids, labels.masked_fill(mask == 0, -100))
    torch.testing.assert_close(masked.loss, ignored.loss)
    assert masked.num_tokens == ignored.num_tokens == 10


def test_layout_errors_name_the_numbers():
    from moefold.parallel.dims import ParallelConfig, ParallelDims

    dims = ParallelDims(sizes=ParallelConfig(tp=8).resolve(8))  # sizes only: the checks run before any group
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by tp=8"):
        MoEDecoder(mixtral_tiny(), dims)
    dims = ParallelDims(sizes=ParallelConfig(ep=8).resolve(8))
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by ep=8"):
        MoEDecoder(mixtral_tiny(), dims)


def test_bad_input():
    with pytest.raises(ValueError, match=r"layer_ids \[5\] are outside \[0, num_layers=2\)"):
        MoEDecoder(mixtral_tiny(), layer_ids=[5])
    with pytest.raises(ValueError, match=r"moe_layer_freq pattern has 3 entries, num_layers=2"):
        mixtral_tiny().with_(moe_layer_freq=(1, 1, 1))
    with pytest.raises(ValueError, match=r"layers \[1\] are dense and need ffn_hidden_size > 0"):
        mixtral_tiny().with_(moe_layer_freq=(1, 0))
    with pytest.raises(ValueError, match=r"attention='mha' is not one of \('gqa', 'mla'\)"):
        mixtral_tiny().with_(attention="mha")
    with pytest.raises(ValueError, match=r"family='llama' is not one of"):
        mixtral_tiny().with_(family="llama")
    with pytest.raises(ValueError,
                       match=r"moe_score_function='relu' is not one of \('softmax', 'sigmoid', 'sqrtsoftplus'\)"):
        mixtral_tiny().with_(moe_score_function="relu")
    model = MoEDecoder(mixtral_tiny())
    ids, labels = _batch(512)
    with pytest.raises(ValueError, match=r"labels \(2, 7\) must have the shape of input_ids \(2, 8\)"):
        model(ids, labels[:, :7])
    with pytest.raises(ValueError, match="dispatcher='bogus'"):
        ModelOptions(dispatcher="bogus")
