"""The planner's time model: cluster presets and sizes, communication volumes against the bytes the code actually
passes to torch.distributed, and the step-time estimate's behaviour."""

from __future__ import annotations

import dataclasses
import inspect
from collections import Counter
from contextlib import contextmanager
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moefold.dense.context_parallel import context_parallel_positions
from moefold.execution import ExecutionPlan, apply_execution, build_decoder
from moefold.execution.recompute import apply_recompute
from moefold.models.layer_factory import build_block
from moefold.models.options import ModelOptions
from moefold.models.recipes import deepseek_v3_tiny, gpt_oss_tiny, minimax_m2_tiny, qwen3_moe_30b_a3b, qwen3_moe_tiny
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.pipeline.decoder_stage import DecoderStage, build_stage_model, decoder_microbatches
from moefold.pipeline.executor import run_schedule
from moefold.pipeline.schedules import build_schedule
from moefold.planner import comm, pipeline_clock, static, step_time
from moefold.planner.cluster import CLUSTERS, Cluster, load_cluster, parse_bytes
from moefold.planner.collective import GROUP_DIMS, Collective
from moefold.planner.grid import group_members
from moefold.planner.step_time import EFFICIENCY, estimate_step_time
from moefold.precision.fp8 import FP8Config
from moefold.training.build import model_options
from moefold.training.config import RunConfig, TrainConfig
from moefold.training.optim import grad_sync, param_sync
from moefold.training.optim.buffers import ALIGN
from moefold.training.optim.grad_sync import GradSync
from moefold.training.optim.param_sync import ParamSync
from tests.distributed import own_groups, run_distributed

WORLD = 4
B, S = 2, 16


# ----------------------------------------------------------------------------------------------- cluster
def test_presets_state_their_sources_and_sizes_parse():
    assert set(CLUSTERS) == {"h100", "h200", "h800", "a100", "b200", "gb200", "gb300"}
    for c in CLUSTERS.values():
        assert "datasheet" in c.source or "H100" in c.source
        assert c.internode_gbps < c.nvlink_gbps
    assert CLUSTERS["h800"].nvlink_gbps < CLUSTERS["h100"].nvlink_gbps
    # Blackwell: twice Hopper's NVLink and more than twice its dense peaks; GB300 the most memory and network
    for name in ("b200", "gb200", "gb300"):
        b = CLUSTERS[name]
        assert b.nvlink_gbps == 2 * CLUSTERS["h100"].nvlink_gbps and b.fp8_tflops == 2 * b.bf16_tflops > 2 * 989
    assert CLUSTERS["gb300"].memory_bytes == 288 * 10**9 and CLUSTERS["gb300"].internode_gbps == 100
    assert load_cluster("h200").memory_bytes == 141 * 10**9
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("141G") == 141 * 10**9
    assert parse_bytes("1.5TB") == 1_500_000_000_000
    assert parse_bytes(" 512 mib ") == 512 * 2**20
    for bad in ("80XB", "GB", "-1GB", "", "0"):
        with pytest.raises(ValueError, match="80GB"):
            parse_bytes(bad)


def test_cluster_toml(tmp_path):
    good = tmp_path / "mine.toml"
    good.write_text('memory = "96GiB"\nbf16_tflops = 500\nnvlink_gbps = 300\ninternode_gbps = 25\nsource = "me"\n')
    c = load_cluster(str(good))
    assert c == Cluster("mine", 96 * 2**30, 500, 300, 25, "me")   # no FP8 units, an H100's HBM unless given
    good.write_text('memory = "96GiB"\nbf16_tflops = 500\nnvlink_gbps = 300\ninternode_gbps = 25\nfp8_tflops = 1000\n'
                    'hbm_gbps = 2000\n')
    assert (load_cluster(str(good)).fp8_tflops, load_cluster(str(good)).hbm_gbps) == (1000, 2000)
    cases = {
        "typo.toml": ('memory = "80GB"\nbf16_tflop = 1\nnvlink_gbps = 1\ninternode_gbps = 1\n', "unknown keys"),
        "missing.toml": ('memory = "80GB"\nnvlink_gbps = 1\ninternode_gbps = 1\n', "missing"),
        "both.toml": ('memory = "80GB"\nmemory_bytes = 1\nbf16_tflops = 1\nnvlink_gbps = 1\ninternode_gbps = 1\n',
                      "exactly one"),
        "negative.toml": ('memory = "80GB"\nbf16_tflops = -1\nnvlink_gbps = 1\ninternode_gbps = 1\n', "positive"),
        "fp8.toml": ('memory = "80GB"\nbf16_tflops = 1\nnvlink_gbps = 1\ninternode_gbps = 1\nfp8_tflops = -1\n',
                     ">= 0"),
        "hbm.toml": ('memory = "80GB"\nbf16_tflops = 1\nnvlink_gbps = 1\ninternode_gbps = 1\nhbm_gbps = 0\n',
                     "positive"),
        "broken.toml": ("memory = \n", "not valid TOML"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=message):
            load_cluster(str(tmp_path / name))
    with pytest.raises(ValueError, match="neither a preset"):
        load_cluster("h300")
    with pytest.raises(ValueError, match="no such file"):
        load_cluster(str(tmp_path / "absent.toml"))


# ----------------------------------------------------------------------------------------------- collectives
class CollectiveLog:
    """Wraps torch.distributed's collectives: records (phase, group ranks, op, bytes) of every call, bytes as
    ``Collective`` counts them (all-gather output, reduce-scatter input, all-to-all send buffer, ...)."""

    WRAPPED: ClassVar[dict[str, tuple[str, str]]] = {"all_gather_into_tensor": ("all_gather", "output_tensor"),
                                                     "all_gather_single": ("all_gather", "output_tensor"),
                                                     "reduce_scatter_tensor": ("reduce_scatter", "input"),
                                                     "reduce_scatter_single": ("reduce_scatter", "input"),
                                                     "all_reduce": ("all_reduce", "tensor"),
                                                     "all_to_all_single": ("all_to_all", "input")}

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.phase = "forward"
        self._depth = 0

    def _record(self, op: str, tensor: torch.Tensor, group) -> None:
        ranks = tuple(sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)))
        self.calls[(self.phase, ranks, op, tensor.numel() * tensor.element_size())] += 1

    def _wrap(self, name: str, original):
        op, arg = self.WRAPPED[name]
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
            if self._depth == 0:   # one torch function may call another: count the outermost only
                bound = signature.bind(*args, **kwargs)
                self._record(op, bound.arguments[arg], bound.arguments.get("group"))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
        return wrapper

    def _wrap_p2p(self, original):
        def wrapper(ops):
            for p in ops:
                if p.op in (dist.isend, dist.send):
                    self._record("send", p.tensor, p.group)
            return original(ops)
        return wrapper

    @contextmanager
    def installed(self):
        saved = {name: getattr(dist, name) for name in [*self.WRAPPED, "batch_isend_irecv"]}
        for name in self.WRAPPED:
            setattr(dist, name, self._wrap(name, saved[name]))
        dist.batch_isend_irecv = self._wrap_p2p(saved["batch_isend_irecv"])
        # the gradient and parameter buffers' collectives, bound once at import (torch's newer names)
        bound = [(grad_sync, "reduce_scatter_into", "reduce_scatter_single"),
                 (grad_sync, "all_gather_into", "all_gather_single"),
                 (param_sync, "all_gather_into", "all_gather_single")]
        kept = [(module, attr, getattr(module, attr)) for module, attr, _ in bound]
        for (module, attr, name), (_, _, fn) in zip(bound, kept):
            setattr(module, attr, self._wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
            for module, attr, fn in kept:
                setattr(module, attr, fn)


def _run_config(model, options: ModelOptions, **parallel) -> RunConfig:
    p = ParallelConfig(**parallel)
    dp = p.resolve(WORLD).dp
    model = dataclasses.replace(model, moe_router_force_load_balancing=True)
    return RunConfig(model=model, parallel=p, options=options,
                     train=TrainConfig(micro_batch_size=B, global_batch_size=B * dp, seq_length=S))


def _layouts() -> dict[str, RunConfig]:
    qwen = dataclasses.replace(qwen3_moe_tiny(), hidden_size=32, ffn_hidden_size=32, first_k_dense_replace=1)
    qwen_aux = dataclasses.replace(qwen, moe_load_balancing_type="aux_loss", moe_shared_expert_ffn_size=16)
    ds = dataclasses.replace(deepseek_v3_tiny(), hidden_size=32, ffn_hidden_size=32, mtp_num_layers=1)
    oss = dataclasses.replace(gpt_oss_tiny(), hidden_size=32)
    minimax = dataclasses.replace(minimax_m2_tiny(), hidden_size=32)
    return {
        # GPT-OSS: sinks and a window under SP and the CP ring, expert biases over etp (the w2 bias's all-reduce)
        "tp2 sp cp2 gpt_oss ep2 etp2 alltoall": _run_config(oss, ModelOptions(), tp=2, cp=2, ep=2, etp=2),
        # qk-norm over the whole projection: sums of squares all-reduced over tp (k's too: 2 kv heads split)
        "tp2 sp dp2 minimax_m2 ep2 alltoall": _run_config(minimax, ModelOptions(), tp=2, ep=2),
        # ... and with kv heads replicated over tp4 (k's norm local)
        "tp4 nosp minimax_m2 ep4 allgather": _run_config(minimax, ModelOptions(sequence_parallel=False,
                                                                              dispatcher="allgather"), tp=4, ep=4),
        # GQA with qk-norm, SP, CP ring; chunked all-to-all (4 local experts); shared experts
        "tp2 sp cp2 ep2 alltoall": _run_config(qwen_aux, ModelOptions(), tp=2, cp=2, ep=2),
        # kv heads replicated over tp=4 (weight-gradient all-reduces); 2 local experts; global aux loss over tp x dp
        "tp4 sp ep4 alltoall": _run_config(qwen, ModelOptions(), tp=4, ep=4),
        # no SP (copy_to_region / all-reduce, MoE token split over tp); etp gather; FP8 dispatch; full recompute
        # (its recompute stops before the dense MLP's output all-reduce and the MoE layer's output gather)
        "tp2 nosp dp2 ep2 etp2 alltoall fp8, full recompute": _run_config(
            qwen_aux, ModelOptions(sequence_parallel=False, fp8=FP8Config(dispatch=True), recompute="full"),
            tp=2, ep=2, etp=2),
        # selective recompute of the shared experts alone (recomputed up to their down-projection)
        "tp2 sp dp2 ep4 allgather, selective shared experts": _run_config(
            qwen_aux, ModelOptions(dispatcher="allgather", recompute="selective",
                                   recompute_modules=("shared_experts", "layernorm", "moe_act")), tp=2, ep=4),
        # MLA, CP all-gather mode, allgather dispatcher over ep4, seq-aux loss over tp x cp
        "cp2 all_gather dp2 mla ep4 allgather": _run_config(
            ds, ModelOptions(cp_comm="all_gather", dispatcher="allgather"), cp=2, ep=4),
        # MLA latents under SP; allgather over etp x ep
        "tp2 sp dp2 mla ep2 etp2 allgather": _run_config(ds, ModelOptions(dispatcher="allgather"), tp=2, ep=2, etp=2),
        # padded capacity mode: E x capacity rows travel, no counts are exchanged
        "tp2 sp ep4 alltoall, padded capacity 2": _run_config(
            dataclasses.replace(qwen, moe_expert_capacity_factor=2.0, moe_pad_expert_input_to_capacity=True),
            ModelOptions(), tp=2, ep=4),
        # latent experts: the dispatch moves moe_latent_size-wide rows (alltoall over tp2 x ep2, allgather over ep4)
        "tp2 sp cp2 ep2 alltoall, latent 16": _run_config(dataclasses.replace(qwen_aux, moe_latent_size=16),
                                                          ModelOptions(), tp=2, cp=2, ep=2),
        "tp2 sp dp2 ep4 allgather, latent 8": _run_config(dataclasses.replace(qwen, moe_latent_size=8),
                                                          ModelOptions(dispatcher="allgather"), tp=2, ep=4),
        # full recompute runs every forward collective of the block again in backward
        "tp2 sp cp2 ep2 alltoall, full recompute": _run_config(qwen_aux, ModelOptions(recompute="full"), tp=2, cp=2,
                                                               ep=2),
        # selective: core attention (the CP exchange), MLA up-projections (latent gathers), the MoE layer, the MLP
        "tp2 sp cp2 mla ep2 alltoall, selective": _run_config(
            ds, ModelOptions(recompute="selective", recompute_modules=("core_attn", "mla_up_proj", "moe", "mlp")),
            tp=2, cp=2, ep=2),
    }


def _measure(layouts: dict[str, RunConfig]) -> list[tuple[str, str, Counter, Counter]]:
    """On every rank, per layout: one forward + backward of a dense and of an MoE block, and of the embedding and
    the head; the collectives they call against those ``planner.comm`` predicts."""
    rank, out = dist.get_rank(), []
    for name, config in layouts.items():
        with own_groups():
            dims = ParallelDims.build(config.parallel)
            sizes, options, model = dims.sizes, model_options(config), config.model
            for index in (0, 1):   # first_k_dense_replace=1: block 0 dense, block 1 MoE
                moe = model.is_moe_layer(index)
                torch.manual_seed(index)
                block = build_block(model, index, dims, options)
                s = S // sizes.cp
                local = s // sizes.tp if options.sequence_parallel and sizes.tp > 1 else s
                x = torch.randn(local, B, model.hidden_size, requires_grad=True)
                positions = context_parallel_positions(S, dims.cp_rank, sizes.cp)
                if options.recompute == "selective":
                    apply_recompute(block, nn.ModuleDict(), options)
                log = CollectiveLog()
                with log.installed():
                    y, extra = block(x, positions)
                    loss = y.square().sum() + (extra.aux_loss if extra is not None else 0)
                    log.phase = "backward"
                    loss.backward()
                collectives = comm.block_collectives(config, sizes, moe, device_type="cpu")
                collectives += comm.recompute_collectives(collectives, options, full=options.recompute == "full",
                                                          moe=moe)
                out.append((name, "MoE block" if moe else "dense block", log.calls,
                            _predicted(collectives, sizes, rank)))
            # the embedding and the output head with its vocab-parallel loss (and the MTP depths): no decoder layers
            decoder = build_decoder(model, dims, options, layer_ids=[])
            ids = torch.randint(0, model.vocab_size, (B, S // sizes.cp))
            log = CollectiveLog()
            with log.installed():
                loss = decoder(ids, ids).loss
                log.phase = "backward"
                loss.backward()
            collectives = comm.embedding_collectives(config, sizes) + comm.head_collectives(config, sizes)
            for _ in range(model.mtp_num_layers):
                collectives += comm.mtp_collectives(config, sizes, device_type="cpu")
            out.append((name, "embedding, head and MTP", log.calls, _predicted(collectives, sizes, rank)))
    return out


def _predicted(collectives: list[Collective], sizes, rank: int) -> Counter:
    predicted = Counter()
    for c in collectives:
        ranks = tuple(group_members(sizes, rank, GROUP_DIMS[c.group]))
        predicted[(c.phase, ranks, c.op, c.bytes)] += 1
    return predicted


def test_block_collectives_equal_the_bytes_the_code_sends():
    results = run_distributed(_measure, WORLD, _layouts(), timeout=240)
    for rank, per_rank in enumerate(results):
        for name, part, measured, predicted in per_rank:
            assert measured, f"{name}, {part}: no collective seen"
            assert measured == predicted, (
                f"{name}, {part}, rank {rank}:\n  measured, not predicted: {dict(measured - predicted)}\n"
                f"  predicted, not measured: {dict(predicted - measured)}")


# ----------------------------------------------------------------------------------------------- step time
def _step(world: int, gpus_per_node: int = 8, cluster: str = "h100", options: ModelOptions | None = None,
          gbs: int = 64, model=None, efficiency: float | None = None, **parallel):
    options = options or ModelOptions(dtype="bf16")
    config = RunConfig(model=model or qwen3_moe_30b_a3b(), parallel=ParallelConfig(**parallel), options=options,
                       train=TrainConfig(micro_batch_size=1, global_batch_size=gbs, seq_length=4096))
    sizes, _ = config.resolve(world)
    return estimate_step_time(config, sizes, load_cluster(cluster), gpus_per_node, efficiency)


def test_one_gpu_runs_at_the_stated_efficiency():
    """The flat model, nothing to communicate: the step is the model's FLOPs at EFFICIENCY x peak, MFU = EFFICIENCY."""
    st = _step(1, gbs=4, efficiency=EFFICIENCY)
    assert st.terms["compute"] == pytest.approx(st.total, rel=1e-12)
    assert st.mfu(load_cluster("h100")) == pytest.approx(EFFICIENCY, rel=1e-9)
    assert st.tokens_per_step == 4 * 4096 and st.gpus == 1
    assert set(st.terms) <= set(st.exposed_notes) and all(st.exposed_notes[k] for k in st.terms)
    full = _step(1, gbs=4, options=ModelOptions(dtype="bf16", recompute="full"), efficiency=EFFICIENCY)
    # full recompute runs every layer's forward again (not the head's): between 1x and 4/3x the compute
    assert st.terms["compute"] < full.terms["compute"] < 4 / 3 * st.terms["compute"]
    assert full.mfu(load_cluster("h100")) < EFFICIENCY


def test_links_follow_the_rank_order():
    intra, inter = _step(8, gpus_per_node=8, ep=8), _step(8, gpus_per_node=4, ep=8)
    assert intra.links["ep"] == "NVLink" and inter.links["ep"] == "network" and "tp" not in intra.links
    assert inter.terms["ep"] > 2 * intra.terms["ep"] > 0
    assert inter.terms["compute"] == intra.terms["compute"]
    assert inter.tokens_per_s_per_gpu < intra.tokens_per_s_per_gpu
    # H800's NVLink is slower than H100's: intra-node EP takes longer, compute does not
    h800 = _step(8, gpus_per_node=8, cluster="h800", ep=8)
    assert h800.terms["ep"] > intra.terms["ep"] and h800.terms["compute"] == intra.terms["compute"]
    # tp inside a node, dp across nodes at 2 GPUs per node: tp on NVLink (but for the router's global-aux
    # all-reduce over tp x dp, 64 bytes), the gradient sync on the network
    small, large = _step(8, gpus_per_node=2, tp=2, ep=4), _step(8, gpus_per_node=8, tp=2, ep=4)
    assert small.terms["tp"] == pytest.approx(large.terms["tp"], rel=1e-3)
    assert small.terms["dp"] > 2 * large.terms["dp"] > 0


def test_shared_experts_hide_the_token_exchange():
    shared = dataclasses.replace(qwen3_moe_30b_a3b(), moe_shared_expert_ffn_size=2048)
    alone, hidden = _step(16, gpus_per_node=8, ep=16), _step(16, gpus_per_node=8, ep=16, model=shared)
    assert hidden.terms["ep"] < alone.terms["ep"] and hidden.terms["compute"] > alone.terms["compute"]
    gathered = _step(16, gpus_per_node=8, ep=16, model=shared, options=ModelOptions(dtype="bf16",
                                                                                      dispatcher="allgather"))
    assert gathered.terms["ep"] > hidden.terms["ep"]   # allgather's gathers finish before the shared experts run


def test_bubble_shrinks_with_more_micro_batches():
    assert _step(8, ep=8).terms["bubble"] == 0
    shares = []
    for gbs in (8, 16, 64):
        st = _step(8, pp=4, ep=2, gbs=gbs)
        assert st.terms["bubble"] > 0
        shares.append(st.terms["bubble"] / st.total)
    assert shares[0] > shares[1] > shares[2]
    # 1F1B with (nearly) equal stages: the textbook bubble (pp-1)/(m+pp-1) of the step, within the stages' spread
    m = 64 // 2
    assert shares[2] == pytest.approx(3 / (m + 3), rel=0.25)


def test_cp_ring_hides_behind_attention_and_virtual_stages_shrink_the_bubble():
    p2p = _step(8, cp=2, ep=4, gbs=16)
    gathered = _step(8, cp=2, ep=4, gbs=16, options=ModelOptions(dtype="bf16", cp_comm="all_gather"))
    assert 0 <= p2p.terms["cp"] < gathered.terms["cp"]
    plain = _step(8, pp=4, ep=2, gbs=16)
    config = RunConfig(model=qwen3_moe_30b_a3b(), parallel=ParallelConfig(pp=4, ep=2),
                       options=ModelOptions(dtype="bf16"),
                       train=TrainConfig(micro_batch_size=1, global_batch_size=16, seq_length=4096,
                                         num_layers_per_virtual_pipeline_stage=6))
    sizes, _ = config.resolve(8)
    interleaved = estimate_step_time(config, sizes, load_cluster("h100"), 8)
    assert interleaved.terms["bubble"] < plain.terms["bubble"]
    with pytest.raises(ValueError, match="gpus-per-node"):
        estimate_step_time(config, sizes, load_cluster("h100"), 0)


# ----------------------------------------------------------------------------------------------- a pipelined step
M = 2


def _pipeline_layouts() -> dict[str, RunConfig]:
    ds = dataclasses.replace(deepseek_v3_tiny(), hidden_size=32, ffn_hidden_size=32, num_layers=4, mtp_num_layers=0,
                             moe_router_force_load_balancing=True)
    train = {"micro_batch_size": B, "seq_length": S}
    return {
        "pp2 tp2 sp ep2 1f1b": RunConfig(model=ds, parallel=ParallelConfig(pp=2, tp=2, ep=2),
                                         train=TrainConfig(global_batch_size=B * M, **train)),
        "pp2 dp2 ep2 interleaved vpp2": RunConfig(
            model=ds, parallel=ParallelConfig(pp=2, ep=2),
            train=TrainConfig(global_batch_size=B * M * 2, num_layers_per_virtual_pipeline_stage=1, **train)),
    }


def _measure_step(layouts: dict[str, RunConfig], numels: dict[str, dict[int, dict]]) -> list[tuple]:
    """On every rank: one pipelined step (run_schedule, then the gradient reduce-scatter and parameter all-gather
    of the distributed optimizer's buffers), collectives logged against what the planner predicts."""
    rank, out = dist.get_rank(), []
    for name, config in layouts.items():
        dims = ParallelDims.build(config.parallel)
        sizes, options = dims.sizes, model_options(config)
        layout = config.pipeline_layout(sizes.pp)
        torch.manual_seed(0)
        model = build_stage_model(config.model, dims, options, layout)
        apply_execution(model, ExecutionPlan(options), dims)
        stage = DecoderStage(model, layout, dims.pp_rank)
        sync = GradSync(model.named_parameters(), dims, bucket_numel=config.train.bucket_numel, overlap=False)
        ids = torch.randint(0, config.model.vocab_size, (M * B, S))
        schedule = build_schedule(config.schedule_name(layout.vpp), sizes.pp, M, layout.vpp)
        log = CollectiveLog()
        with log.installed():
            sync.start_step(M)
            run_schedule(stage, schedule, decoder_microbatches(ids, ids, None, M), stage.loss_fn, dims.pp_group,
                         stage.activation_spec(B, S))
            log.phase = "step"
            sync.finish()
            ParamSync(sync.groups).launch()
        predicted = Counter()
        for chunk in step_time.rank_chunks(config, sizes, dims.pp_rank):
            per_micro = comm.pipeline_collectives(config, sizes, chunk.model_chunk, sizes.pp * layout.vpp)
            for i in chunk.layers:
                per_micro += comm.block_collectives(config, sizes, config.model.is_moe_layer(i), device_type="cpu")
            per_micro += comm.embedding_collectives(config, sizes) if chunk.has_embedding else []
            per_micro += comm.head_collectives(config, sizes) if chunk.has_head else []
            for c in per_micro:   # forwards and backwards interleave: compare without the phase
                predicted[(tuple(group_members(sizes, rank, GROUP_DIMS[c.group])), c.op, c.bytes)] += M
        measured = Counter()
        for (phase, ranks, op, nbytes), count in log.calls.items():
            if phase != "step":
                measured[(ranks, op, nbytes)] += count
        step_measured, step_predicted = Counter(), Counter()
        for (phase, ranks, op, nbytes), count in log.calls.items():
            if phase == "step":
                step_measured[(ranks, op)] += nbytes * count
        numel = numels[name][dims.pp_rank]
        for c in comm.grad_sync_collectives(config, sizes, numel):
            step_predicted[(tuple(group_members(sizes, rank, GROUP_DIMS[c.group])), c.op)] += c.bytes
        n_params = len([p for p in model.parameters() if p.requires_grad])
        out.append((name, measured, predicted, step_measured, step_predicted, n_params))
    return out


def test_pipelined_step_moves_the_predicted_bytes():
    """A whole pipelined step: per micro-batch, every layer's, the embedding's, the head's and the stage boundaries'
    collectives exactly; per step, the distributed optimizer's gradient reduce-scatter and parameter all-gather
    to within the buckets' alignment padding (the planner counts parameters per kind, not their boundaries)."""
    layouts = _pipeline_layouts()
    numels = {}
    for name, config in layouts.items():
        sizes, _ = config.resolve(WORLD)
        numels[name] = {r: static.stage_numel(config, sizes, r) for r in range(sizes.pp)}
    results = run_distributed(_measure_step, WORLD, layouts, numels, timeout=240)
    for rank, per_rank in enumerate(results):
        for name, measured, predicted, step_measured, step_predicted, n_params in per_rank:
            assert any(ranks != (rank,) and op == "send" for ranks, op, _ in measured), f"{name}: no p2p seen"
            assert measured == predicted, (
                f"{name}, rank {rank}:\n  measured, not predicted: {dict(measured - predicted)}\n"
                f"  predicted, not measured: {dict(predicted - measured)}")
            assert set(step_measured) == set(step_predicted), (name, rank, step_measured, step_predicted)
            for key, nbytes in step_measured.items():
                # each parameter starts ALIGN-aligned and each bucket is padded to n x ALIGN elements (fp32 here)
                slack = (n_params + 1) * len(key[0]) * ALIGN * 4
                assert 0 <= nbytes - step_predicted[key] <= slack, (name, rank, key, nbytes, step_predicted[key])


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_long_steps_extrapolate_the_simulated_makespan_exactly(name, vpp):
    """Past the warm-up each micro-batch adds the same time: three short simulations give the long one (also its busy
    times and, with the batch-level overlap, the exchange hidden)."""
    g = torch.Generator().manual_seed(5)

    def rand() -> float:
        return torch.rand((), generator=g).item()

    durations = tuple(tuple((0.5 + rand(), 1 + 2 * rand(), 0.3, (0.1 * rand(), 0.4), (0.2 * rand(), 0.8))
                            for _ in range(vpp)) for _ in range(4))
    for overlap in (False, True) if name == "interleaved" else (False,):
        pipeline_clock.simulate_step.cache_clear()
        extrapolated = pipeline_clock.step_makespan(name, 4, vpp, 80, durations, overlap)
        # m = 80 was not simulated
        assert pipeline_clock.simulate_step.cache_info().currsize == len(pipeline_clock.PROBES)
        exact = pipeline_clock.simulate_step(name, 4, vpp, 80, durations, overlap)
        assert extrapolated[0] == pytest.approx(exact[0], rel=1e-12)
        assert extrapolated[1] == pytest.approx(exact[1], rel=1e-12)
        assert extrapolated[2] == pytest.approx(exact[2], rel=1e-12) and (exact[2] > 0) == overlap
