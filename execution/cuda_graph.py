"""CUDA graphs per scope (Megatron-Core 0.18's ``--cuda-graph-impl local|transformer_engine``).

    graphs = apply_cuda_graphs(model, CudaGraphPlan(CudaGraphImpl.LOCAL, {CudaGraphScope.ATTN, ...}), device)

Each scope of ``--cuda-graph-modules`` is a region of every block it names (``dense.regions``), installed with the
layer's own ``configure``:

============== ========================================================================================
scope          region
============== ========================================================================================
(none given)   the whole layer: the block's ``body`` (a dense layer; an MoE layer only where it is sync-free)
``attn``       the block's ``attn``: the attention module (projections, RoPE, core attention, output)
``mlp``        the ``ffn`` region of the dense-MLP blocks
``moe``        the ``ffn`` region of the MoE blocks: router, dispatch, experts, combine, shared experts
``moe_router`` the MoE layer's ``router``: the gate GEMM, scores, top-k, the balancing losses
``moe_preprocess`` the MoE layer's ``preprocess``: the dispatcher's local preparation (with ``moe_router``)
============== ========================================================================================

The scopes run eagerly for the first ``warmup_steps`` training steps (lazy initialisation, autotuning; the trainer
calls ``end_step()`` after each step's forward and backward); the last warm-up step records each scope's inputs,
once per call signature (``CallVariant``: the first micro-batch's router takes no global load state, micro-batch m
counts m micro-batches in it, so each has its own graphs, as Megatron keeps a graph per micro-batch). At the end of
that step every recorded variant is captured at once, in the order they first ran, by
``torch.cuda.make_graphed_callables`` (Transformer Engine's under ``transformer_engine``): it warms each one up on
a side stream, captures every forward in order and every backward in reverse into one memory pool (shared by all
the graphs, which is safe because training replays them in that order), with the recorded inputs as the static
input buffers; replay copies each call's tensors into them. The default CUDA generator is graph-safe (its seed and
offset are graph inputs), so dropout and router jitter replay fresh noise.
Evaluation (no grad, or ``eval()``) runs the scopes eagerly.

Off CUDA the same scopes run the capture-equivalent path (``execution.graph_capture.StaticRun``): static buffers
copied in and out around an eager run, which the CPU tests compare with plain eager.

A scope can be captured only if it makes no host synchronisation and every call has the same shapes and host
values; ``moe_refusal`` says which MoE layers cannot (dropless all-to-all reads its split sizes on the host...),
and a call whose shapes or host values differ from the captured ones fails in one line naming the scope.
Only one micro-batch's activations of a scope live in its static buffers: no pipeline schedule, no batch-level
overlap (``training.build`` refuses them). Nothing here crosses ranks (a captured dispatch's collectives aside).
"""

from __future__ import annotations

import enum
import importlib.util
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from moefold.dense.block import TransformerBlock
from moefold.dispatch.config import DispatcherKind
from moefold.execution.graph_capture import (
    CallSpec,
    StaticRun,
    StaticState,
    flatten_call,
    static_like,
    structure,
)
from moefold.moe.gemm_backend import GemmBackend
from moefold.moe.layer import MoELayer


class CudaGraphImpl(enum.Enum):
    """``--cuda-graph-impl``."""

    NONE = "none"
    LOCAL = "local"
    TRANSFORMER_ENGINE = "transformer_engine"
    FULL_ITERATION = "full_iteration"


class CudaGraphScope(enum.Enum):
    """``--cuda-graph-modules`` (``LAYER``: none given, the whole layer)."""

    LAYER = "layer"
    ATTN = "attn"
    MLP = "mlp"
    MOE = "moe"
    MOE_ROUTER = "moe_router"
    MOE_PREPROCESS = "moe_preprocess"


@dataclass(frozen=True)
class CudaGraphPlan:
    """What to capture: ``impl``, the per-layer ``scopes`` (empty: the whole layer; full_iteration: none), the
    eager training ``warmup_steps`` before the capture."""

    impl: CudaGraphImpl = CudaGraphImpl.NONE
    scopes: frozenset[CudaGraphScope] = field(default_factory=frozenset)
    warmup_steps: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "impl", CudaGraphImpl(self.impl))
        object.__setattr__(self, "scopes", frozenset(CudaGraphScope(s) for s in self.scopes))
        if CudaGraphScope.LAYER in self.scopes:
            raise ValueError("CudaGraphPlan: the whole layer is the empty scope set, not 'layer'")
        if self.scopes and self.impl not in (CudaGraphImpl.LOCAL, CudaGraphImpl.TRANSFORMER_ENGINE):
            raise ValueError(f"--cuda-graph-modules {' '.join(sorted(s.value for s in self.scopes))} needs "
                             f"--cuda-graph-impl local or transformer_engine (got {self.impl.value})")
        inner = {CudaGraphScope.MOE_ROUTER, CudaGraphScope.MOE_PREPROCESS}
        if CudaGraphScope.MOE in self.scopes and self.scopes & inner:
            raise ValueError("--cuda-graph-modules moe already captures the router and the dispatch preprocessing: "
                             "give moe, or moe_router (moe_preprocess)")
        if CudaGraphScope.MOE_PREPROCESS in self.scopes and CudaGraphScope.MOE_ROUTER not in self.scopes:
            raise ValueError("--cuda-graph-modules moe_preprocess must be paired with moe_router (as in Megatron)")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 1:
            raise ValueError(f"--cuda-graph-warmup-steps={self.warmup_steps!r} must be an integer >= 1 (the eager "
                             "steps record the static inputs)")

    @property
    def per_layer(self) -> bool:
        return self.impl in (CudaGraphImpl.LOCAL, CudaGraphImpl.TRANSFORMER_ENGINE)

    def wants(self, scope: CudaGraphScope) -> bool:
        return scope in self.scopes if self.scopes else scope is CudaGraphScope.LAYER


def impl_unavailable(impl: CudaGraphImpl) -> str | None:
    """Why ``impl`` cannot run in this installation (one line), or None."""
    if impl is CudaGraphImpl.TRANSFORMER_ENGINE and importlib.util.find_spec("transformer_engine") is None:
        return ("--cuda-graph-impl transformer_engine needs Transformer Engine (pip install "
                "'transformer_engine[pytorch]'); --cuda-graph-impl local captures the same scopes with torch's "
                "make_graphed_callables")
    return None


def moe_refusal(moe: MoELayer, scope: CudaGraphScope) -> str | None:
    """Why ``scope`` of this MoE layer cannot be captured (a host sync or a dynamic shape), or None. ``moe_router``
    is always capturable: the router's shapes are fixed by the tokens and top-k, and it reads nothing on the host."""
    if scope is CudaGraphScope.MOE_ROUTER:
        return None
    d, router = moe.dispatcher, moe.router.config
    dropless = router.expert_capacity_factor is None
    padded = router.pad_expert_input_to_capacity
    if d.kind is DispatcherKind.ALLGATHER:
        return "the allgather dispatcher reads the gathered per-expert counts on the host (a host sync)"
    if d.kind is DispatcherKind.ALLTOALL and dropless:
        return ("dropless alltoall reads the exchange's split sizes on the host (a host sync; the received rows are "
                "a dynamic shape): use --moe-expert-capacity-factor with --moe-pad-expert-input-to-capacity, or "
                "the flex dispatcher on DeepEP V2")
    if not dropless and not padded and d.kind is not DispatcherKind.FLEX:
        return ("capacity without --moe-pad-expert-input-to-capacity reads the kept rows' count on the host (a host "
                "sync; a dynamic shape)")
    if d.kind is DispatcherKind.FLEX and type(d).__name__ == "FlexDispatcher":
        return "the legacy DeepEP dispatch waits on the host for the received counts (a host sync)"
    if d.kind is DispatcherKind.FLEX and getattr(d, "cpu_sync", False):
        return "--moe-deepep-cpu-sync makes DeepEP's dispatch wait on the host for the received counts"
    if scope is CudaGraphScope.MOE_PREPROCESS:
        return None
    if getattr(moe.experts.gemm, "needs_host_counts", False):
        return "the expert GEMM backend reads the per-expert row counts on the host (a host sync)"
    dtype = next(moe.experts.parameters()).dtype
    if getattr(moe.experts.gemm, "backend", None) is GemmBackend.GROUPED_MM and dtype != torch.bfloat16:
        return (f"torch's grouped_mm in {str(dtype).removeprefix('torch.')} falls back to a loop that reads the "
                "offsets on the host (a host sync; its grouped kernel is bf16 only): train with --bf16")
    return None


def step_refusal(model: nn.Module) -> str | None:
    """Why ``full_iteration`` cannot capture ``model``'s step (one line, naming the MoE block), or None."""
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    for i, block in enumerate(blocks):
        why = moe_refusal(block.mlp, CudaGraphScope.MOE) if isinstance(block.mlp, MoELayer) else None
        if why is not None:
            return f"--cuda-graph-impl full_iteration: cannot capture MoE block {i}: {why}"
    return None


@dataclass(eq=False)
class CallVariant:
    """One call of a scope in a pass (a micro-batch's forward and backward) with its own graphs: ``spec`` fixes the
    call's structure, host values and shapes. ``state``: off CUDA, its static buffers and recorded forward."""

    scope: GraphedScope
    spec: CallSpec
    sample: list[Tensor]
    fn: Callable[..., Any]
    runner: Callable[[Sequence[Tensor]], Any] | None = None
    state: StaticState | None = None

    def call(self, args: tuple, kwargs: dict) -> Any:
        return self.fn(*args, **kwargs)


class GraphedScope:
    """A region (``region(fn, *args, **kwargs)``) whose calls replay graphs after the warm-up (module docstring).
    ``owner``: the module whose ``training`` flag decides between graph and eager; ``params``: the parameters its
    backward produces gradients for. ``variants``: {(pass, call key): CallVariant} (``CudaGraphs``)."""

    def __init__(self, manager: CudaGraphs, name: str, owner: nn.Module, params: Sequence[nn.Parameter]) -> None:
        self.manager, self.name, self.owner, self.params = manager, name, owner, tuple(params)
        self.variants: dict[tuple[int, Any], CallVariant] = {}

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not (torch.is_grad_enabled() and self.owner.training):
            return fn(*args, **kwargs)
        spec, leaves = flatten_call((args, kwargs))
        m = self.manager
        pass_index = m.enter(self)
        if not m.is_captured:
            if m.steps == m.plan.warmup_steps - 1:   # the last warm-up step: record the static inputs
                m.record(CallVariant(self, spec, [static_like(t) for t in leaves], fn), pass_index)
            return fn(*args, **kwargs)
        v = self.variants.get((m.group.get(pass_index, -1), spec.key))
        if v is None:
            raise RuntimeError(f"CUDA graph scope {self.name}: cannot replay its graphs: "
                               f"{self._unseen(spec, pass_index)}")
        why = v.spec.mismatch(spec)
        if why is not None:
            raise RuntimeError(f"CUDA graph scope {self.name}: cannot replay its graph: {why}")
        return v.runner(leaves)

    def _unseen(self, spec: CallSpec, pass_index: int) -> str:
        """Why a call after the capture matches none of the warm-up's (one phrase)."""
        if pass_index not in self.manager.group:
            return f"micro-batch {pass_index} of the step was not in the warm-up step (more micro-batches?)"
        for v in self.variants.values():
            if structure(v.spec.tree) == structure(spec.tree):
                return v.spec.mismatch(spec) or "a call signature the warm-up never made"
        return "a call signature the warm-up never made (a host value or an argument's presence changed)"

    def __repr__(self) -> str:
        return f"CUDA_GRAPH({self.name})"


class _ScopeModule(nn.Module):
    """What ``make_graphed_callables`` captures for one call variant: tensors in, tensors out, its parameters."""

    def __init__(self, variant: CallVariant) -> None:
        super().__init__()
        self.variant = [variant]   # not a submodule: the model's modules stay where they are
        self.graph_params = nn.ParameterList([p for p in variant.scope.params if p.requires_grad])
        self.out_spec: CallSpec | None = None

    def forward(self, *leaves: Tensor) -> tuple[Tensor, ...]:
        v = self.variant[0]
        spec, out = flatten_call(v.call(*v.spec.rebuild(leaves)))
        self.out_spec = spec
        return tuple(out)


class CudaGraphs:
    """The per-scope graphs of one model (module docstring).

    Passes: a training step runs its micro-batches one after the other, each a *pass* over the scopes (forward,
    then backward in reverse). A pass ends where a scope is called a second time; ``end_step`` ends the last. The
    last warm-up step records every pass's calls; passes whose calls are equal (same scopes, order and keys) share
    graphs (``group``: pass -> the first such pass), and every other pass (the first micro-batch's routers take no
    global load state; micro-batch m's state counts m micro-batches) gets graphs of its own, as Megatron keeps
    graphs per micro-batch. The graphs are captured in one call, pass after pass, into one memory pool: each pass
    replays its graphs in the captured order, forward before backward, so no graph reuses memory another holds.
    """

    def __init__(self, plan: CudaGraphPlan, device: torch.device) -> None:
        self.plan, self.device = plan, device
        self.scopes: list[GraphedScope] = []
        self.captured = 0
        self.steps = 0
        self.on_cuda = device.type == "cuda"
        self.group: dict[int, int] = {}
        self.is_captured = False
        self._pass, self._in_pass = 0, set()
        self._recorded: dict[int, list[CallVariant]] = {}

    def scope(self, name: str, owner: nn.Module, params: Iterable[nn.Parameter] = ()) -> GraphedScope:
        s = GraphedScope(self, name, owner, list(params))
        self.scopes.append(s)
        return s

    def enter(self, scope: GraphedScope) -> int:
        """The pass ``scope``'s call belongs to (a second call of a scope starts the next pass)."""
        if id(scope) in self._in_pass:
            self._pass, self._in_pass = self._pass + 1, set()
        self._in_pass.add(id(scope))
        return self._pass

    def record(self, variant: CallVariant, pass_index: int) -> None:
        self._recorded.setdefault(pass_index, []).append(variant)

    def end_step(self) -> None:
        """The trainer's step is over (forward and backward of every micro-batch): after the last warm-up step,
        capture."""
        self.steps += 1
        self._pass, self._in_pass = 0, set()
        if self.steps == self.plan.warmup_steps:
            self.capture()

    def capture(self) -> None:
        """Capture the recorded passes' graphs (CUDA), or give each variant its static-buffer path (elsewhere)."""
        leaders: dict[tuple, int] = {}
        todo: list[CallVariant] = []
        for p, calls in sorted(self._recorded.items()):
            signature = tuple((id(v.scope), v.spec.key) for v in calls)
            self.group[p] = leaders.setdefault(signature, p)
            for v in calls if self.group[p] == p else ():
                if (p, v.spec.key) not in v.scope.variants:   # a scope called twice alike in a pass: one graph
                    v.scope.variants[(p, v.spec.key)] = v
                    todo.append(v)
        self._recorded = {}
        if self.on_cuda:
            self._capture_cuda(todo)
        else:
            for v in todo:
                v.state = state = StaticState(v.call, v.scope.params, v.spec, v.sample)
                v.runner = lambda leaves, st=state: _rebuild(StaticRun.apply(st, *leaves, *st.params), st.out_spec)
        for v in todo:
            v.sample = []
        self.captured += len(todo)
        self.is_captured = True

    def _capture_cuda(self, todo: list[CallVariant]) -> None:
        modules = tuple(_ScopeModule(v) for v in todo)
        samples = tuple(tuple(v.sample) for v in todo)
        # the capture's warm-up runs each forward more than once: a buffer that a forward updates in place (quantile
        # balancing's accumulated quantiles) gets its value back afterwards
        buffers = {id(b): b for v in todo for b in v.scope.owner.buffers()}
        saved = [(b, b.clone()) for b in buffers.values()]
        if self.plan.impl is CudaGraphImpl.TRANSFORMER_ENGINE:
            # delegated, as Megatron does (TE imported only here)
            from transformer_engine.pytorch import make_graphed_callables as make

            graphed = make(modules, samples, num_warmup_iters=3, allow_unused_input=True)
        else:
            pool = torch.cuda.graph_pool_handle()   # one pool for every graph (class docstring)
            graphed = torch.cuda.make_graphed_callables(modules, samples, num_warmup_iters=3,
                                                        allow_unused_input=True, pool=pool)
        for b, value in saved:
            b.copy_(value)
        for v, module, g in zip(todo, modules, graphed):   # (TE may hand back a wrapper: the spec stays ours)
            v.runner = lambda leaves, g=g, mod=module: _rebuild(_as_captured(g(*leaves), mod.out_spec), mod.out_spec)


def _as_captured(outputs: Sequence[Tensor], spec: CallSpec) -> list[Tensor]:
    """The graphed callable's outputs with the autograd state they had when captured: make_graphed_callables lets
    every floating output require grad; one that did not (a detached statistic, a load state passed to the next
    micro-batch) is detached again, so that the next call's inputs match the captured ones."""
    return [o if meta.requires_grad else o.detach() for o, meta in zip(outputs, spec.tensors)]


def _rebuild(outputs: Sequence[Tensor], spec: CallSpec | None) -> Any:
    """A scope's result from its graph's (or static run's) flat outputs."""
    return spec.rebuild(list(outputs))


def apply_cuda_graphs(model: nn.Module, plan: CudaGraphPlan, device: torch.device) -> CudaGraphs:
    """Install ``plan``'s scopes as regions of every block of ``model`` (ValueError, one line, for an MoE scope that
    cannot be captured). Returns the manager (``scopes``: what was installed)."""
    graphs = CudaGraphs(plan, device)
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    for i, block in enumerate(blocks):
        moe = block.mlp if isinstance(block.mlp, MoELayer) else None
        for scope in (CudaGraphScope.LAYER, CudaGraphScope.MOE, CudaGraphScope.MOE_PREPROCESS):
            why = moe_refusal(moe, scope) if moe is not None and plan.wants(scope) else None
            if why is not None:
                name = "the whole layer (no --cuda-graph-modules)" if scope is CudaGraphScope.LAYER else scope.value
                raise ValueError(f"--cuda-graph-impl {plan.impl.value}: cannot capture {name} of MoE block {i}: "
                                 f"{why}")
        if plan.wants(CudaGraphScope.LAYER):
            block.configure(body=graphs.scope(f"layer {i}", block, block.parameters()))
        if plan.wants(CudaGraphScope.ATTN):
            block.configure(attn=graphs.scope(f"attn {i}", block.self_attn, block.self_attn.parameters()))
        if plan.wants(CudaGraphScope.MLP) and moe is None:
            block.configure(ffn=graphs.scope(f"mlp {i}", block.mlp, block.mlp.parameters()))
        if moe is not None and plan.wants(CudaGraphScope.MOE):
            block.configure(ffn=graphs.scope(f"moe {i}", moe, moe.parameters()))
        if moe is not None and plan.wants(CudaGraphScope.MOE_ROUTER):
            moe.configure(router=graphs.scope(f"moe_router {i}", moe, moe.router.parameters()))
        if moe is not None and plan.wants(CudaGraphScope.MOE_PREPROCESS):
            moe.configure(preprocess=graphs.scope(f"moe_preprocess {i}", moe))
    return graphs


__all__ = ["CallVariant", "CudaGraphImpl", "CudaGraphPlan", "CudaGraphScope", "CudaGraphs", "GraphedScope",
           "apply_cuda_graphs", "impl_unavailable", "moe_refusal", "step_refusal"]
