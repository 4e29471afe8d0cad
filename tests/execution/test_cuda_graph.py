"""CUDA graphs on the CPU (``execution.cuda_graph``, ``execution.step_graph``): the precondition of a capture and the
dataflow of the captured step, proved without a GPU.

- each scope of ``--cuda-graph-modules`` (and the whole layer), after its warm-up, runs through its static buffers
  (``StaticRun``: inputs copied in, outputs and gradients at fixed addresses), and a model trained through them
  gives plain eager's losses and gradients, step after step (fp32: the same kernels in the same order, so equal
  to rounding);
- inside every scope, forward and backward, ``HostSyncCounter`` counts no host synchronisation, and the tensors its
  operators create have the same shapes and dtypes from one step to the next (what a graph's fixed addresses need);
- the full iteration (``StepGraph``): the trainer's step run on static buffers equals plain eager, with zero host
  syncs and the same allocations step to step for padded and dropless-local routing;
- refusals, one line each: dropless all-to-all (split sizes on the host), allgather, unpadded capacity, the fused
  gradient accumulation, pipelines; a call whose shape changes after the capture names its scope.
(On a GPU: ``tests/gpu/test_cuda_graph_cuda.py``.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moefold.execution import ExecutionPlan, apply_execution
from moefold.execution.cuda_graph import CudaGraphImpl, CudaGraphPlan, CudaGraphScope, moe_refusal
from moefold.execution.step_graph import StepGraph
from moefold.models.decoder import MoEDecoder
from moefold.models.options import ModelOptions
from moefold.models.recipes import get_recipe
from moefold.moe.layer import MoELayer
from moefold.parallel.dims import ParallelConfig
from moefold.precision.fp8 import FP8Config
from moefold.training.observe.host_sync import HostSyncCounter
from moefold.training.sections import CUDA_GRAPH_IMPLS, CUDA_GRAPH_MODULES, ExecutionConfig

S = CudaGraphScope
OPTIONS = ModelOptions(dtype="bf16")
PADDED = {"moe_expert_capacity_factor": 1.5, "moe_pad_expert_input_to_capacity": True}


class AllocationTrace(TorchDispatchMode):
    """Every operator's outputs as (operator, shape, dtype): the allocations a graph would fix."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.records.append((str(func), tuple(t.shape), t.dtype))
        return out


def _model(recipe: str = "deepseek_v3_tiny", **model) -> MoEDecoder:
    """bf16 (torch's grouped_mm reads its offsets on the host in other dtypes: ``moe_refusal``)."""
    config = get_recipe(recipe).with_(**{"num_layers": 2, "vocab_size": 128, **model})
    m = MoEDecoder(config, options=OPTIONS)
    m.init_weights(3)
    return m


def _batch(step: int, vocab: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (2, 17), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _step(model: MoEDecoder, step: int, graphs=None) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(*_batch(step))
    out.loss.backward()
    if graphs is not None:
        graphs.end_step()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _graphed(plan: CudaGraphPlan, recipe: str = "deepseek_v3_tiny", **model):
    m = _model(recipe, **model)
    done = apply_execution(m, ExecutionPlan(OPTIONS, cuda_graphs=plan), log=lambda _m: None)
    return m, done.cuda_graphs


SCOPES = [frozenset(), frozenset({S.ATTN, S.MLP, S.MOE}), frozenset({S.ATTN, S.MOE_ROUTER, S.MOE_PREPROCESS})]


@pytest.mark.parametrize("scopes", SCOPES, ids=["layer", "attn-mlp-moe", "attn-router-preprocess"])
def test_scopes_equal_eager(scopes) -> None:
    """Four steps on fresh data: the static-buffer path after two warm-up steps equals plain eager (deepseek: a dense
    first layer, MLA, shared experts, expert bias, group-limited top-k; padded capacity for the whole MoE layer)."""
    plan = CudaGraphPlan(CudaGraphImpl.LOCAL, scopes, warmup_steps=2)
    model = {} if scopes and S.MOE not in scopes else PADDED
    eager = _model(**model)
    graphed, graphs = _graphed(plan, **model)
    for step in range(4):
        loss, grads = _step(eager, step)
        g_loss, g_grads = _step(graphed, step, graphs)
        assert g_loss == pytest.approx(loss, rel=1e-6, abs=1e-6), step
        assert grads.keys() == g_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(g_grads[name], grad, rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")
    installed = {s.name.split()[0] for s in graphs.scopes}
    assert graphs.captured == sum(len(s.variants) for s in graphs.scopes) and installed == ({"layer"} if not scopes else
                                                                   {s.value for s in scopes})
    # every scope ran its static path; the routers twice: the first micro-batch's call takes no global load state
    assert all(v.state is not None for s in graphs.scopes for v in s.variants.values())


def test_scopes_have_no_host_sync_and_fixed_allocations() -> None:
    """Every scope's forward and backward: zero host syncs; the same operator outputs (shape, dtype) at steps 2 and
    3 (after the capture), for the scopes of both MoE granularities (dropless local dispatch: fixed N = T k rows)."""
    for scopes, model in (({S.ATTN, S.MOE_ROUTER, S.MOE_PREPROCESS}, {}), ({S.MLP, S.MOE}, PADDED),
                          ({S.MOE}, {})):
        graphed, graphs = _graphed(CudaGraphPlan(CudaGraphImpl.LOCAL, frozenset(scopes), warmup_steps=1),
                                   **model)
        traces: dict[tuple[str, int, str], list] = {}
        step_now = [0]

        def watched(scope, part, run):
            def wrapper(*args):
                trace = AllocationTrace()
                with HostSyncCounter() as syncs, trace:
                    out = run(*args)
                assert syncs.total == 0, f"{scope}.{part}: {syncs.report()}"
                traces[(scope, step_now[0], part)] = trace.records
                return out
            return wrapper

        for step in range(4):
            step_now[0] = step
            if step == 1:   # captured after step 0: watch every static run from here on
                for s in graphs.scopes:
                    for v in s.variants.values():
                        v.state.forward = watched(s.name, "forward", v.state.forward)
                        v.state.backward = watched(s.name, "backward", v.state.backward)
            _step(graphed, step, graphs)
        for s in graphs.scopes:
            for part in ("forward", "backward"):
                first, second = traces[(s.name, 2, part)], traces[(s.name, 3, part)]
                assert first and first == second, f"{s.name} {part}: allocations differ between steps"


def test_moe_refusals_name_the_part_and_why() -> None:
    cases = [
        ({"moe_token_dispatcher_type": "alltoall"}, "split sizes on the host"),
        ({"moe_token_dispatcher_type": "allgather"}, "gathered per-expert counts on the host"),
        ({"moe_expert_capacity_factor": 1.0}, "kept rows' count on the host"),
    ]
    for options, reason in cases:
        dispatcher = options.pop("moe_token_dispatcher_type", "local")
        m = MoEDecoder(get_recipe("qwen3_moe_tiny").with_(num_layers=1, vocab_size=64, **options),
                       options=ModelOptions(dispatcher=dispatcher))
        moe = next(x for x in m.modules() if isinstance(x, MoELayer))
        assert reason in moe_refusal(moe, S.MOE)
        assert moe_refusal(moe, S.MOE_ROUTER) is None
        plan = ExecutionPlan(ModelOptions(), cuda_graphs=CudaGraphPlan(CudaGraphImpl.LOCAL, frozenset({S.MOE})))
        with pytest.raises(ValueError, match=rf"cannot capture moe of MoE block 0: .*{reason}") as err:
            apply_execution(m, plan, log=lambda _m: None)
        assert "\n" not in str(err.value)
        full = ExecutionPlan(ModelOptions(), cuda_graphs=CudaGraphPlan(CudaGraphImpl.FULL_ITERATION))
        with pytest.raises(ValueError, match=rf"full_iteration: cannot capture MoE block 0: .*{reason}"):
            apply_execution(m, full, log=lambda _m: None)


def test_plan_and_flag_refusals() -> None:
    local = CudaGraphPlan(CudaGraphImpl.LOCAL)
    with pytest.raises(ValueError, match=r"local cannot be combined with --gradient-accumulation-fusion"):
        ExecutionPlan(ModelOptions(), grad_accumulation_fusion=True, cuda_graphs=local)
    with pytest.raises(ValueError, match=r"--compile"):
        ExecutionPlan(ModelOptions(), compile=True, cuda_graphs=local)
    with pytest.raises(ValueError, match=r"--recompute-granularity selective"):
        ExecutionPlan(ModelOptions(recompute="selective"), cuda_graphs=local)
    with pytest.raises(ValueError, match=r"--fp8-backend te: Transformer Engine's autocast"):
        ExecutionPlan(ModelOptions(fp8=FP8Config(format="e4m3", backend="te")), cuda_graphs=local)
    with pytest.raises(ValueError, match=r"moe_preprocess must be paired with moe_router"):
        ExecutionConfig(cuda_graph_impl="local", cuda_graph_modules=("moe_preprocess",))
    with pytest.raises(ValueError, match=r"moe already captures the router"):
        ExecutionConfig(cuda_graph_impl="local", cuda_graph_modules=("moe", "moe_router"))
    with pytest.raises(ValueError, match=r"needs --cuda-graph-impl local or transformer_engine"):
        ExecutionConfig(cuda_graph_impl="full_iteration", cuda_graph_modules=("attn",))
    with pytest.raises(ValueError, match=r"--cuda-graph-warmup-steps=0"):
        ExecutionConfig(cuda_graph_impl="local", cuda_graph_warmup_steps=0)
    with pytest.raises(ValueError, match=r"batch-level overlap or a zero-bubble schedule"):
        ExecutionConfig(cuda_graph_impl="local", pipeline_schedule="zb-h1", gradient_accumulation_fusion=False)
    with pytest.raises(ValueError, match=r"--cuda-graph-impl local cannot be combined with "
                                         r"--gradient-accumulation-fusion \(on by default\)"):
        ExecutionConfig(cuda_graph_impl="local")
    # the flags' names are the enums' values
    assert tuple(i.value for i in CudaGraphImpl) == CUDA_GRAPH_IMPLS
    assert tuple(s.value for s in CudaGraphScope if s is not S.LAYER) == CUDA_GRAPH_MODULES


def test_pipeline_and_param_gather_refused_before_the_model() -> None:
    from moefold.parallel.dims import ParallelDims
    from moefold.training.build import cuda_graph_plan
    from tests.training.trainer_common import tiny_config

    dims = ParallelDims.single()
    config = tiny_config(cuda_graph_impl="local", overlap_param_gather=True, gradient_accumulation_fusion=False)
    with pytest.raises(ValueError, match=r"local cannot be combined with --overlap-param-gather"):
        cuda_graph_plan(config, dims)
    config = tiny_config(cuda_graph_impl="full_iteration", fp16=True, gradient_accumulation_fusion=False)
    with pytest.raises(ValueError, match=r"full_iteration cannot be combined with --fp16"):
        cuda_graph_plan(config, dims)
    assert cuda_graph_plan(tiny_config(ParallelConfig(), cuda_graph_impl="full_iteration",
                                       gradient_accumulation_fusion=False), dims).impl \
        is CudaGraphImpl.FULL_ITERATION


def test_a_changed_shape_after_capture_names_the_scope() -> None:
    graphed, graphs = _graphed(CudaGraphPlan(CudaGraphImpl.LOCAL, frozenset({S.ATTN}), warmup_steps=1))
    _step(graphed, 0, graphs)
    _step(graphed, 1, graphs)
    ids, labels = _batch(2)
    with pytest.raises(RuntimeError, match=r"CUDA graph scope attn 0: cannot replay its graph: tensor 0 is "
                                           r"\[8, 2, 64\].*captured as \[16, 2, 64\] .*\(a dynamic shape\)"):
        graphed(ids[:, :8], labels[:, :8])


def test_eval_runs_eagerly() -> None:
    graphed, graphs = _graphed(CudaGraphPlan(CudaGraphImpl.LOCAL, frozenset({S.ATTN}), warmup_steps=1))
    _step(graphed, 0, graphs)
    _step(graphed, 1, graphs)
    graphed.eval()
    with torch.no_grad():
        short = graphed(*[t[:, :8] for t in _batch(2)])   # another shape: fine outside training
    assert torch.isfinite(short.loss)


def _trainer_steps(recipe: str, impl: str, model: dict, steps: int = 3, modules: tuple[str, ...] = ()):
    from moefold.parallel.dims import ParallelDims
    from moefold.training.trainer import Trainer
    from tests.training.trainer_common import tiny_config, tiny_data

    config = tiny_config(recipe=recipe, steps=steps, model=model, gradient_accumulation_fusion=False, bf16=True,
                         cuda_graph_impl=impl, cuda_graph_modules=modules, cuda_graph_warmup_steps=1)
    trainer = Trainer(config, ParallelDims.single(), log=lambda _m: None)
    data = torch.from_numpy(tiny_data())
    losses = [trainer.train_step([data[4 * s + m:4 * s + m + 1] for m in range(4)]).loss_lm for s in range(steps)]
    return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer


@pytest.mark.parametrize("recipe,model,impl,modules", [
    ("qwen3_moe_tiny", PADDED, "full_iteration", ()), ("deepseek_v3_tiny", {}, "full_iteration", ()),
    ("qwen3_moe_tiny", {}, "local", ("attn", "moe_router", "moe_preprocess"))],
    ids=["full-qwen3-padded", "full-deepseek-dropless-local", "local-qwen3-router"])
def test_trainer_steps_equal_eager(recipe: str, model: dict, impl: str, modules: tuple[str, ...]) -> None:
    """Three optimizer steps of four micro-batches through ``StepGraph``'s static buffers, or through the scopes
    (each router with two call variants: the first micro-batch has no global load state), equal plain steps: the
    losses, and the parameters the optimizer made of the gradients (the trainer's hooks and main grads included)."""
    losses, params, _ = _trainer_steps(recipe, "none", model)
    g_losses, g_params, trainer = _trainer_steps(recipe, impl, model, modules=modules)
    if impl == "full_iteration":
        assert trainer.step_graph is not None and trainer.step_graph.steps == 3
    else:
        assert trainer.execution.cuda_graphs.captured >= 3
    assert g_losses == pytest.approx(losses, rel=1e-6)
    for name, p in params.items():
        torch.testing.assert_close(g_params[name], p, rtol=1e-5, atol=1e-6, msg=name)


def test_micro_batches_share_graphs_where_their_calls_are_equal() -> None:
    """Qwen3's routers carry the global load state from micro-batch to micro-batch (None, then a count of 1, 2, 3
    micro-batches): each of the 4 passes gets its own graphs (6 scopes x 4); Mixtral's calls are equal in every
    micro-batch: one set of 6, replayed 4 times a step."""
    modules = ("attn", "moe_router", "moe_preprocess")
    for recipe, groups, graphs in (("qwen3_moe_tiny", {0: 0, 1: 1, 2: 2, 3: 3}, 24),
                                   ("mixtral_tiny", {0: 0, 1: 0, 2: 0, 3: 0}, 6)):
        _, _, trainer = _trainer_steps(recipe, "local", {}, steps=2, modules=modules)
        g = trainer.execution.cuda_graphs
        assert (g.group, g.captured, len(g.scopes)) == (groups, graphs, 6), recipe


def test_full_iteration_step_has_no_host_sync_and_fixed_allocations() -> None:
    """The captured part of a step (every micro-batch's forward and backward): zero host syncs, and the same
    operator outputs at two steps."""
    _, _, trainer = _trainer_steps("qwen3_moe_tiny", "full_iteration", PADDED, steps=1)
    from moefold.training.observe.expert_counts import ROUTER_SUMS
    from tests.training.trainer_common import tiny_data

    data = torch.from_numpy(tiny_data())
    E = trainer.config.model.num_experts
    traces = []
    for step in (1, 2):
        loads = torch.zeros(len(trainer.moe_layers), E + 1 + ROUTER_SUMS + E, dtype=torch.float64)
        logged = torch.zeros(4, dtype=torch.float64)
        trainer.sync.start_step(4)
        trace = AllocationTrace()

        def step_fn(mbs, acc):
            with HostSyncCounter() as syncs, trace:
                trainer._forward_backward(mbs, *acc)
            assert syncs.total == 0, syncs.report()

        trainer.step_graph.run(step_fn, [data[4 * step + m:4 * step + m + 1] for m in range(4)], [loads, logged])
        trainer.sync.finish()
        assert logged[0] > 0 and loads.sum() > 0   # the accumulators came back out of the static buffers
        traces.append(trace.records)
    assert traces[0] and traces[0] == traces[1]


def test_step_graph_refuses_a_changed_shape() -> None:
    g = StepGraph(1, torch.device("cpu"))
    acc = torch.zeros(2)
    g.run(lambda ins, accs: accs[0].add_(ins[0].sum()), [torch.ones(3)], [acc])
    assert acc.tolist() == [3.0, 3.0]
    with pytest.raises(RuntimeError, match=r"step 2's inputs .* differ from the captured .* \(a dynamic shape\)"):
        g.run(lambda ins, accs: None, [torch.ones(4)], [acc])
    assert dataclasses.is_dataclass(CudaGraphPlan())
