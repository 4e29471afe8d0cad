"""Every module honours ``device=`` (issue 42: the router made its weight, bias and expert bias on the default
device while the experts took ``device=``, so a CUDA layer mixed devices in the router's GEMM).

Each case builds a module with ``device="meta"`` and no ``torch.device`` context (the default device stays the
CPU, checked before and after) and asserts that every parameter and buffer is on meta, naming the first that is
not; then it runs a forward and a backward on meta inputs (meta tensors carry shapes, not values), where shapes do
not depend on values read on the host: each case that cannot says why (``no_run``), and is skipped with that reason.

Coverage is by class: every ``nn.Module`` subclass defined in moefold.parallel / dense / dispatch / moe / models /
pipeline needs a case here or a place in ``NO_TENSORS`` (modules that hold no tensor and so take no device), so a
new module class fails ``test_every_module_class_has_a_case`` until it gets one. Every recipe is built (cut to its
first ``LAYERS`` layers, the true sizes otherwise: meta costs nothing), in bf16 because the meta kernel of
``grouped_mm`` takes bf16 only (CUDA's rule; the CPU kernel also runs fp32).
The activation offloader of a meta model stays on meta and copies nothing to the host; the workspace pool of the
expert path allocates on its device. Training's parts (``build_model`` at tp / ep / pp layouts, the flex
dispatcher, the optimizer's buffers and its offload): tests/training/test_build_device.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn

from moefold.dense import (
    OFFLOAD_MODULES,
    AttentionConfig,
    ColumnParallelLinear,
    CoreAttention,
    DenseMLP,
    GatedDeltaNet,
    GatedDeltaNetConfig,
    GQAAttention,
    MLAConfig,
    MLAttention,
    MLPConfig,
    OutputHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    TransformerBlock,
    VocabParallelEmbedding,
    YarnConfig,
)
from moefold.dense.compressed_attention import CompressedAttention, V4AttentionConfig, V4AttentionKind
from moefold.dense.dsa import DSAttention
from moefold.dense.dsa_indexer import DSAConfig, LightningIndexer
from moefold.dense.gated_deltanet import CausalConv1d, GatedRMSNorm
from moefold.dense.hyper_connections import HyperConnection, HyperHead
from moefold.dense.kv_compression import CompressedIndexer, IndexScorer, KVCompressor
from moefold.dense.mamba2 import Mamba2Config, Mamba2Mixer
from moefold.dense.workspace import MIN_BYTES, workspace
from moefold.dispatch.config import DispatchConfig
from moefold.execution import build_decoder
from moefold.execution.offloader import ActivationOffloader
from moefold.models.decoder import MoEDecoder
from moefold.models.generate import CachedCoreAttention
from moefold.models.mtp import MTPModule
from moefold.models.options import ModelOptions
from moefold.models.recipes import RECIPES, get_recipe
from moefold.moe.build import build_experts, build_moe_layer
from moefold.moe.config import ExpertsConfig, MoEConfig, SharedExpertsConfig
from moefold.moe.experts import GroupedExperts
from moefold.moe.hash_router import HashRouter
from moefold.moe.latent import LatentProjection
from moefold.moe.layer import MoELayer
from moefold.moe.router import Router
from moefold.moe.router_config import RouterConfig
from moefold.moe.shared_experts import SharedExperts
from moefold.parallel.dims import ParallelDims
from moefold.precision.fp8 import FP8Config
from tests.moe import grouped_gemm_standin, te_standin

PACKAGES = ("parallel", "precision", "dense", "dispatch", "moe", "models", "pipeline")
NO_TENSORS = (CoreAttention, CachedCoreAttention)   # hold no parameter or buffer: nothing to place
LAYERS = 4
S, B, H, V, E = 8, 2, 16, 64, 4
COUNTS = (3, 0, 6, 1)   # rows per expert (an expert without rows), given as host counts
HOST_COUNTS = "reads the tokens per expert on the host, which a meta tensor does not hold"
META = torch.device("meta")


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


def positions() -> Tensor:
    return torch.arange(S, device=META)


@dataclass(frozen=True)
class Case:
    """``build(device)`` one module of class ``cls``; ``run(module)`` one forward on meta inputs (its outputs), or
    ``no_run``: why not. ``standins``: the optional GPU libraries it needs, stood in (tests/moe)."""

    cls: type[nn.Module]
    label: str
    build: Callable[[torch.device | str], nn.Module]
    run: Callable[[nn.Module], object] | None = None
    no_run: str = ""
    standins: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.label


def _recipe(name: str) -> object:
    """Recipe ``name`` cut to its first ``LAYERS`` layers (every per-layer tuple cut with it)."""
    c = get_recipe(name)
    n = min(c.num_layers, LAYERS)
    per_layer = {name: v[:n] for name, v in c.flat_dict().items()   # every section's value by its flat name
                 if isinstance(v, tuple) and len(v) == c.num_layers}
    if c.v4 is not None:   # DeepSeek-V4's per-layer attention kinds live in its v4 section
        per_layer["v4"] = dataclasses.replace(c.v4, attention_kinds=c.v4.attention_kinds[:n],
                                              num_hash_layers=min(c.v4.num_hash_layers, n))
    return c.with_(num_layers=n, **per_layer)


def _decoder(config: object, options: ModelOptions) -> Callable[[torch.device | str], nn.Module]:
    return lambda d: build_decoder(config, ParallelDims.single(), options, device=d)


def _run_decoder(m: MoEDecoder) -> object:
    ids = meta(B, S, dtype=torch.long)
    return m(ids, ids).loss


def _run_offloaded(m: MoEDecoder) -> object:
    loss = _run_decoder(m)
    assert m.offloader.device == META and not m.offloader.stats, "a meta model's offloader copied to the host"
    return loss


BF16 = ModelOptions(dtype="bf16")
ROUTER = RouterConfig(num_experts=E, topk=2, bias=True, enable_expert_bias=True, aux_loss_coeff=0.01,
                      z_loss_coeff=1e-3)


def _moe(dispatcher: str, backend: str = "grouped_mm") -> MoEConfig:
    return MoEConfig(num_experts=E, router=ROUTER, experts=ExpertsConfig(8, gemm_backend=backend, bias=backend != "te"),
                     dispatch=DispatchConfig(dispatcher), shared=SharedExpertsConfig(8, gate=True))


def _moe_case(dispatcher: str, backend: str, standins: tuple[str, ...] = ()) -> Case:
    no_run = (f"the {backend} backend {HOST_COUNTS}" if backend != "grouped_mm" else
              f"the allgather dispatcher {HOST_COUNTS} (its one host sync)" if dispatcher == "allgather" else "")
    return Case(MoELayer, f"MoELayer-{dispatcher}-{backend}",
                lambda d: build_moe_layer(_moe(dispatcher, backend), H, ParallelDims.single(), dtype=torch.bfloat16,
                                          device=d),
                run=None if no_run else (lambda m: m(meta(S, B, H, dtype=torch.bfloat16))), no_run=no_run,
                standins=standins)


def _experts_case(backend: str, dtype: torch.dtype, standins: tuple[str, ...] = (), no_run: str = "",
                  **kw: object) -> Case:
    def run(m: GroupedExperts) -> Tensor:
        return m(meta(sum(COUNTS), H, dtype=dtype), torch.empty(E, dtype=torch.long, device=META), COUNTS)

    return Case(GroupedExperts, f"GroupedExperts-{backend}{'-bias' if kw else ''}",
                lambda d: build_experts(E, H, ExpertsConfig(24, gemm_backend=backend, **kw), dtype=dtype, device=d),
                run=None if no_run else run, no_run=no_run, standins=standins)


def _attention(**kw: object) -> AttentionConfig:
    return AttentionConfig(hidden_size=H, num_heads=4, num_query_groups=2, head_dim=8, **kw)


MLA = MLAConfig(hidden_size=H, num_heads=2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                q_lora_rank=8, yarn=YarnConfig(factor=4.0, original_max_position_embeddings=4))
DELTANET = GatedDeltaNetConfig(hidden_size=H, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8,
                               backend="torch")
DSA = DSAConfig(index_n_heads=2, index_head_dim=8, index_topk=4, loss_coeff=1.0)
V4 = V4AttentionConfig(hidden=H, heads=4, head_dim=8, q_lora_rank=8, o_groups=2, o_lora_rank=4, rope_dim=4, window=4,
                       kind=V4AttentionKind.COMPRESSED_SPARSE, rate=2, index_heads=2, index_head_dim=8, index_topk=2)
MTP_RECIPE = "deepseek_v3_tiny"


def _mtp(d: torch.device | str) -> MTPModule:
    c = get_recipe(MTP_RECIPE)
    return MTPModule(c, c.num_layers, ParallelDims.single(), BF16, device=d)


def _run_mtp(m: MTPModule) -> object:
    h = m.eh_proj.weight.shape[0]
    return m(meta(S, B, h, dtype=torch.bfloat16), meta(S, B, h, dtype=torch.bfloat16), positions())


CASES: tuple[Case, ...] = (
    *(Case(MoEDecoder, f"MoEDecoder-{name}", _decoder(_recipe(name), BF16), run=_run_decoder) for name in RECIPES),
    Case(MoEDecoder, "MoEDecoder-offload", _decoder(_recipe("deepseek_v3_tiny"), dataclasses.replace(
        BF16, offload_modules=tuple(m for m in OFFLOAD_MODULES if m != "attn_proj"), min_offloaded_tensor_size=0)),
         run=_run_offloaded),
    Case(MoEDecoder, "MoEDecoder-fp8", _decoder(_recipe("qwen3_moe_tiny"), dataclasses.replace(
        BF16, fp8=FP8Config(format="e4m3", recipe="tensorwise"))),
         no_run=f"the FP8 expert GEMM without torch._scaled_grouped_mm (CPU, meta) runs per expert and {HOST_COUNTS}"),
    Case(MTPModule, "MTPModule", _mtp, run=_run_mtp),
    Case(ColumnParallelLinear, "ColumnParallelLinear", lambda d: ColumnParallelLinear(H, 24, None, bias=True, device=d),
         run=lambda m: m(meta(S, B, H))),
    Case(RowParallelLinear, "RowParallelLinear", lambda d: RowParallelLinear(24, H, None, bias=True, device=d),
         run=lambda m: m(meta(S, B, 24))),
    Case(RMSNorm, "RMSNorm", lambda d: RMSNorm(H, zero_centered_gamma=True, device=d), run=lambda m: m(meta(S, B, H))),
    Case(RotaryEmbedding, "RotaryEmbedding", lambda d: RotaryEmbedding(8, device=d), run=lambda m: m(positions())),
    Case(RotaryEmbedding, "RotaryEmbedding-yarn", lambda d: RotaryEmbedding(8, yarn=MLA.yarn, device=d),
         run=lambda m: m(positions())),
    Case(VocabParallelEmbedding, "VocabParallelEmbedding", lambda d: VocabParallelEmbedding(V, H, None, device=d),
         run=lambda m: m(meta(S, B, dtype=torch.long))),
    Case(OutputHead, "OutputHead", lambda d: OutputHead(H, V, None, device=d), run=lambda m: m(meta(S, B, H))),
    Case(DenseMLP, "DenseMLP", lambda d: DenseMLP(MLPConfig(H, 32, bias=True), device=d),
         run=lambda m: m(meta(S, B, H))),
    Case(GQAAttention, "GQAAttention", lambda d: GQAAttention(_attention(
        qk_norm=True, sinks=True, output_gate=True, rotary_dim=4, sliding_window=4, bias=True), device=d),
         run=lambda m: m(meta(S, B, H), positions())),
    Case(GQAAttention, "GQAAttention-projection-norm", lambda d: GQAAttention(_attention(
        qk_norm=True, qk_norm_scope="projection"), device=d), run=lambda m: m(meta(S, B, H), positions())),
    Case(MLAttention, "MLAttention", lambda d: MLAttention(MLA, device=d), run=lambda m: m(meta(S, B, H), positions())),
    Case(MLAttention, "MLAttention-no-q-lora", lambda d: MLAttention(dataclasses.replace(MLA, q_lora_rank=None),
                                                                      device=d),
         run=lambda m: m(meta(S, B, H), positions())),
    Case(GatedDeltaNet, "GatedDeltaNet", lambda d: GatedDeltaNet(DELTANET, device=d),
         run=lambda m: m(meta(S, B, H), positions())),
    Case(CausalConv1d, "CausalConv1d", lambda d: CausalConv1d((2, 8), 4, device=d), run=lambda m: m(meta(S, B, 16))),
    Case(GatedRMSNorm, "GatedRMSNorm", lambda d: GatedRMSNorm(8, 1e-6, device=d),
         run=lambda m: m(meta(S, B, 8), meta(S, B, 8))),
    Case(TransformerBlock, "TransformerBlock", lambda d: TransformerBlock(
        H, GQAAttention(_attention(), device=d), DenseMLP(MLPConfig(H, 32), device=d), device=d),
         run=lambda m: m(meta(S, B, H), positions())),
    Case(CoreAttention, "CoreAttention", lambda d: CoreAttention(0.5, sliding_window=4),
         run=lambda m: m(meta(S, B, 4, 8), meta(S, B, 4, 8), meta(S, B, 4, 8), positions())),
    Case(CachedCoreAttention, "CachedCoreAttention", lambda d: CachedCoreAttention(CoreAttention(0.5)),
         run=lambda m: m(meta(S, B, 4, 8), meta(S, B, 4, 8), meta(S, B, 4, 8), positions())),
    Case(Router, "Router", lambda d: Router(ROUTER, H, device=d), run=lambda m: m(meta(S * B, H))),
    Case(LatentProjection, "LatentProjection", lambda d: LatentProjection(H, 8, 0.02, device=d),
         run=lambda m: m(meta(S * B, H))),
    Case(DSAttention, "DSAttention", lambda d: DSAttention(MLA, DSA, device=d), run=lambda m: m(meta(S, B, H),
                                                                                                   positions())),
    Case(LightningIndexer, "LightningIndexer", lambda d: LightningIndexer(DSA, H, 8, 4, device=d),
         no_run="its queries, keys and selection run inside DSAttention's case"),
    Case(HashRouter, "HashRouter", lambda d: HashRouter(RouterConfig(num_experts=E, topk=2), H, 16, device=d),
         run=lambda m: m(meta(S * B, H), token_ids_T=meta(S * B, dtype=torch.long))),
    Case(HyperConnection, "HyperConnection", lambda d: HyperConnection(H, 2, device=d),
         run=lambda m: m(meta(S, B, 2, H))),
    Case(HyperHead, "HyperHead", lambda d: HyperHead(H, 2, device=d), run=lambda m: m(meta(S, B, 2, H))),
    Case(CompressedAttention, "CompressedAttention", lambda d: CompressedAttention(V4, device=d),
         run=lambda m: m(meta(S, B, H), torch.arange(S, device="meta"))),
    Case(KVCompressor, "KVCompressor", lambda d: KVCompressor(H, 8, 2, overlap=True, rope_dim=4, rope_theta=1e4,
                                                              device=d), run=lambda m: m(meta(B, S, H))),
    Case(IndexScorer, "IndexScorer", lambda d: IndexScorer(H, 2, 8, device=d),
         run=lambda m: m(meta(B, S, 2, 8), meta(B, S // 2, 8), meta(B, S, H))),
    Case(CompressedIndexer, "CompressedIndexer", lambda d: CompressedIndexer(H, 8, 2, 8, 2, 2, rope_dim=4,
                                                                            rope_theta=1e4, device=d),
         no_run="its selection reads closed entries built from the host's sequence length; KVCompressor and "
                "IndexScorer run"),
    Case(Mamba2Mixer, "Mamba2Mixer", lambda d: Mamba2Mixer(Mamba2Config(H, 2, 8, 4, chunk_size=4), device=d),
         run=lambda m: m(meta(S, B, H))),
    Case(SharedExperts, "SharedExperts", lambda d: SharedExperts(H, 8, gate=True, device=d),
         run=lambda m: m(meta(S, B, H))),
    _experts_case("grouped_mm", torch.bfloat16),
    _experts_case("loop", torch.float32),
    _experts_case("loop", torch.float32, bias=True),
    _experts_case("grouped_gemm", torch.bfloat16, ("grouped_gemm",)),
    _experts_case("te", torch.float32, ("te",), no_run="the TE stand-in refuses meta weights: it tells TE's own "
                  "weights (kept on meta, never to be used) from the experts' by their device"),
    *(_moe_case(dispatcher, "grouped_mm") for dispatcher in ("local", "allgather", "alltoall")),
    _moe_case("local", "loop"),
    _moe_case("local", "grouped_gemm", ("grouped_gemm",)),
    _moe_case("local", "te", ("te",)),
)
# The flex dispatcher (DeepEP) needs an etp x ep group of >= 2 ranks: tests/training/test_build_device.py builds it
# at ep 2 on a fake process group.


def _module_classes() -> set[type[nn.Module]]:
    found = set()
    for package in PACKAGES:
        pkg = importlib.import_module(f"moefold.{package}")
        for info in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}."):
            mod = importlib.import_module(info.name)
            found |= {obj for obj in vars(mod).values() if inspect.isclass(obj) and issubclass(obj, nn.Module)
                      and obj.__module__ == mod.__name__}
    return found


def off_device(module: nn.Module, device: torch.device) -> list[str]:
    """``name (device)`` of every parameter and buffer of ``module`` not on ``device``."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return [f"{n} ({t.device})" for n, t in tensors if t.device != device]


def _install(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in case.standins:
        {"te": te_standin, "grouped_gemm": grouped_gemm_standin}[name].install(monkeypatch)


@pytest.fixture(autouse=True)
def _default_device_is_cpu():
    """No ``torch.device`` context here, and none left behind: the default device is the CPU throughout."""
    assert torch.empty(0).device.type == "cpu"
    yield
    assert torch.empty(0).device.type == "cpu"


def test_every_module_class_has_a_case():
    covered = {c.cls for c in CASES} | set(NO_TENSORS)
    missing = sorted(f"{c.__module__}.{c.__name__}" for c in _module_classes() - covered)
    assert not missing, f"module classes without a meta-device case here: {missing}"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_builds_on_meta(case, monkeypatch):
    _install(case, monkeypatch)
    module = case.build("meta")
    tensors = [*module.parameters(), *module.buffers()]
    if isinstance(module, NO_TENSORS):
        assert not tensors, f"{case}: holds tensors, so it must take device= and leave NO_TENSORS"
        return
    assert tensors, f"{case}: no parameter or buffer, nothing checked"
    bad = off_device(module, META)
    assert not bad, f"{case}: built with device='meta', {len(bad)} tensors elsewhere, first {bad[0]}"


def _outputs(out: object) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if dataclasses.is_dataclass(out):
        out = [getattr(out, f.name) for f in dataclasses.fields(out)]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _outputs(o)]
    return []


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_backward_on_meta(case, monkeypatch):
    if case.run is None:
        pytest.skip(f"{case}: {case.no_run}")
    _install(case, monkeypatch)
    module = case.build("meta")
    outputs = [t for t in _outputs(case.run(module)) if t.is_floating_point()]
    assert outputs and all(t.is_meta for t in outputs), f"{case}: outputs on {[t.device for t in outputs]}"
    graph = [t for t in outputs if t.requires_grad]
    if not graph:   # RotaryEmbedding: a function of its buffer only
        assert not any(p.requires_grad for p in module.parameters()), f"{case}: no output on the graph"
        return
    sum(t.float().sum() for t in graph).backward()
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    assert grads, f"{case}: backward reached no parameter"
    bad = [n for n, g in grads.items() if not g.is_meta]
    assert not bad, f"{case}: gradients off meta: {bad[:3]}"


def test_workspace_pool_allocates_on_its_device():
    """The expert path's reused buffers (``dense.workspace``) come from the pool of the input's device."""
    pool = workspace("meta")
    large = (MIN_BYTES,)   # above the size the pool hands to torch.empty directly
    for t in (pool.empty(large, torch.bfloat16), pool.zeros(large, torch.float32), pool.empty((4,), torch.float32)):
        assert t.is_meta, t.device


def test_activation_offloader_on_meta_copies_nothing():
    """A region on meta saves its tensors as they are: no host copy of a tensor that has no data (a module without
    parameters, whose storages meta's shared null pointer would not tell apart from a saved tensor's)."""
    offloader = ActivationOffloader("meta", min_tensor_numel=0)
    x, module = meta(S, H).requires_grad_(), nn.Identity()
    with offloader.region("core_attn", 0, module):
        y = x.exp()
    y.sum().backward()
    assert x.grad.is_meta and not offloader.stats
