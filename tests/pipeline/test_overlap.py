"""The batch-level overlap engine (``pipeline.overlap``) on the decoder (``DecoderStage`` with ``OverlapConfig``):

- world 1 (the local dispatcher's exchange is the identity): the pieces cut between sub-layers, run alone and as FB
  steps, give the plain forward's losses and gradients (DeepSeek-V3 tiny: MLA, a dense first layer, shared experts,
  MTP reading the embedding through a borrowed leaf);
- ep2 (gloo): no host synchronisation is added: the overlapped step makes exactly the syncing calls of the plain
  step (``HostSyncCounter``: the dispatch's one split-size read per MoE layer), with and without
  --delay-wgrad-compute;
- the pieces refuse what cannot be cut (a checkpoint around the whole MoE layer, the allgather dispatcher).
"""

from __future__ import annotations

import pytest
import torch

from moefold.dense.split_backward import WeightGradStore
from moefold.execution import build_decoder
from moefold.execution.split_backward import install_weight_grad_store
from moefold.models.decoder import MoEDecoder
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.pipeline.decoder_stage import DecoderStage
from moefold.pipeline.executor import run_schedule
from moefold.pipeline.overlap import OverlapConfig, Trace, cut
from moefold.pipeline.p2p import TensorSpec
from moefold.pipeline.schedules import build_schedule
from moefold.pipeline.stages import StageLayout
from moefold.training.observe.host_sync import HostSyncCounter
from tests.distributed import run_distributed

M, S, B = 3, 16, 2


def _step(config, dims, overlap: bool, delay: bool = False, options: ModelOptions | None = None,
          count: bool = False):
    torch.manual_seed(0)
    model = build_decoder(config, dims, options or ModelOptions())
    model.init_weights(3)
    store = None
    if delay:
        store = WeightGradStore()
        install_weight_grad_store(model, store)
    trace = Trace()
    stage = DecoderStage(model, StageLayout(config.num_layers), 0,
                         OverlapConfig(delay, store, trace) if overlap else None)
    gen = torch.Generator().manual_seed(10 + dims.rank)
    ids = torch.randint(0, config.vocab_size, (M, B, S), generator=gen)
    mbs = [{"index": i, "input_ids": ids[i], "labels": torch.roll(ids[i], -1, 1)} for i in range(M)]
    schedule = build_schedule("1f1b", 1, M, overlap=overlap)
    spec = TensorSpec((S, B, config.hidden_size))
    counter = HostSyncCounter()
    if count:
        with counter:
            result = run_schedule(stage, schedule, mbs, stage.loss_fn, None, spec, weight_store=store)
    else:
        result = run_schedule(stage, schedule, mbs, stage.loss_fn, None, spec, weight_store=store)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return result, grads, counter, trace


def test_world1_pieces_equal_the_plain_forward_and_backward():
    config = get_recipe("deepseek_v3_tiny").with_(num_layers=3, vocab_size=128)
    dims = ParallelDims.single()
    plain, plain_grads, _, _ = _step(config, dims, overlap=False)
    for delay in (False, True):
        got, grads, _, trace = _step(config, dims, overlap=True, delay=delay)
        assert [float(x) for x in got.losses] == [float(x) for x in plain.losses]
        assert float(got.extra_loss) == float(plain.extra_loss)
        assert sorted(grads) == sorted(plain_grads)
        for n, g in plain_grads.items():
            scale = float(g.abs().max()) or 1.0
            assert float((grads[n] - g).abs().max()) <= 1e-6 * scale, n
        # the FB steps ran interleaved: micro-batch 1's forward began before micro-batch 0's backward ended
        assert trace.index("mb1.chunk0.embed", "forward start") < trace.index("mb0.chunk0.embed", "backward end")


def test_cut_replaces_graph_tensors_by_one_leaf_each():
    a = torch.randn(3, requires_grad=True)
    b = a * 2
    carry, pairs = cut({"x": (b, b), "y": a, "z": 5})
    assert len(pairs) == 1 and pairs[0][0] is b
    leaf = pairs[0][1]
    assert carry["x"][0] is leaf and carry["x"][1] is leaf and carry["y"] is a and carry["z"] == 5
    assert leaf.is_leaf and leaf.requires_grad and leaf.data_ptr() == b.data_ptr()


def _sync_world() -> dict:
    dims = ParallelDims.build(ParallelConfig(ep=2))
    config = get_recipe("qwen3_moe_tiny").with_(num_layers=2, vocab_size=128)
    out = {}
    for name, overlap, delay in (("plain", False, False), ("overlap", True, False), ("delay", True, True)):
        result, _, counter, _ = _step(config, dims, overlap, delay, count=True)
        out[name] = (counter.total, counter.report(), [float(x) for x in result.losses])
    return out


def test_overlap_adds_no_host_synchronisation():
    for rank in run_distributed(_sync_world, 2, timeout=300):
        plain_total, plain_report, plain_losses = rank["plain"]
        assert plain_total > 0   # the alltoall dispatch's split sizes, once per MoE layer and micro-batch
        for name in ("overlap", "delay"):
            total, report, losses = rank[name]
            assert total == plain_total, (name, report, plain_report)
            assert losses == pytest.approx(plain_losses, abs=1e-6)


def test_pieces_refuse_what_cannot_be_cut():
    config = get_recipe("qwen3_moe_tiny").with_(num_layers=2, vocab_size=128)
    options = ModelOptions(recompute="selective", recompute_modules=("moe",))
    model = build_decoder(config, ParallelDims.single(), options)
    with pytest.raises(ValueError, match="cannot checkpoint the whole MoE layer"):
        DecoderStage(model, StageLayout(2), 0, OverlapConfig())
    model = MoEDecoder(config, ParallelDims.single(), ModelOptions(dispatcher="allgather"))
    with pytest.raises(ValueError, match="runs with the alltoall and flex dispatchers, not 'allgather'"):
        DecoderStage(model, StageLayout(2), 0, OverlapConfig())
