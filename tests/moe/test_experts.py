"""GroupedExperts: loop reference, init independent of layout, etp/ep shards equal world 1."""

import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from moefold.moe.build import build_experts
from moefold.moe.config import ExpertsConfig, MoEConfig
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.sharding import gather_full, init_parameters, shards_of
from moefold.precision.fp8 import FP8Config
from moefold.precision.fp8_region import fp8_autocast
from moefold.training.observe.host_sync import HostSyncCounter
from tests.distributed import run_distributed
from tests.moe import te_standin

E, H, FFN = 4, 16, 24
COUNTS = [3, 0, 6, 1]  # an expert with no tokens


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    n = sum(COUNTS)
    return torch.randn(n, H, generator=gen).to(dtype), torch.randn(n, H, generator=gen).to(dtype)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_matches_per_expert_mlp(activation, backend):
    experts = build_experts(E, H, ExpertsConfig(FFN, activation=activation, gemm_backend=backend))
    init_parameters(experts, seed=3)
    x, _ = _inputs()
    out = experts(x, torch.tensor(COUNTS))
    rows, start = [], 0
    for i, c in enumerate(COUNTS):
        xi = x[start:start + c]
        if activation == "swiglu":
            h = F.silu(xi @ experts.w13[i, 0].T) * (xi @ experts.w13[i, 1].T)
        else:
            h = F.gelu(xi @ experts.w13[i, 0].T)
        rows.append(h @ experts.w2[i].T)
        start += c
    torch.testing.assert_close(out, torch.cat(rows), atol=1e-6, rtol=1e-5)


def test_bad_sizes_name_numbers():
    with pytest.raises(ValueError, match="activation='relu'"):
        build_experts(E, H, ExpertsConfig(FFN, activation="relu"))
    with pytest.raises(ValueError, match="gemm_backend='x'"):
        build_experts(E, H, ExpertsConfig(FFN, gemm_backend="x"))


def _sharded_vs_world1():
    torch.manual_seed(0)
    x, grad = _inputs()
    starts = [sum(COUNTS[:i]) for i in range(E)]
    ref = build_experts(E, H, ExpertsConfig(FFN))
    init_parameters(ref, seed=5)
    ref_out = ref(x, torch.tensor(COUNTS))
    ref_out.backward(grad)
    for cfg in (ParallelConfig(ep=2, etp=2), ParallelConfig(ep=4), ParallelConfig(etp=4), ParallelConfig(ep=1)):
        dims = ParallelDims.build(cfg)
        mod = build_experts(E, H, ExpertsConfig(FFN), ep_group=dims.ep_group, etp_group=dims.etp_group)
        init_parameters(mod, seed=5)
        lo = dims.ep_rank * mod.num_local_experts
        local = range(lo, lo + mod.num_local_experts)
        rows = torch.cat([torch.arange(starts[i], starts[i] + COUNTS[i]) for i in local])
        out = mod(x[rows], torch.tensor([COUNTS[i] for i in local]))
        out.backward(grad[rows])
        total = out.detach().clone()
        dist.all_reduce(total, group=dims.etp_group)  # partial sums over etp
        torch.testing.assert_close(total, ref_out.detach()[rows], atol=1e-5, rtol=1e-5)
        for name, p in mod.named_parameters():
            full_w = gather_full(p.detach(), shards_of(p))
            full_g = gather_full(p.grad, shards_of(p))
            torch.testing.assert_close(full_w, getattr(ref, name).detach(), atol=0, rtol=0)
            torch.testing.assert_close(full_g, getattr(ref, name).grad, atol=1e-5, rtol=1e-5)
    return True


def test_etp_ep_shards_equal_world1():
    assert all(run_distributed(_sharded_vs_world1, 4))


# ----------------------------------------------------------------------------------------------
# Transformer Engine backend through a stand-in built from TE's signatures (tests/moe/te_standin.py):
# these check the protocol moefold follows (persistent modules, host m_splits, views of the stacked
# weights, parameter names, FP8 autocast and padding), not TE's kernels or FP8 numerics.
# ----------------------------------------------------------------------------------------------
def _te_pair(monkeypatch, **kw):
    pt = te_standin.install(monkeypatch)
    ref = build_experts(E, H, ExpertsConfig(FFN, gemm_backend="loop"))
    init_parameters(ref, seed=3)
    mod = build_experts(E, H, ExpertsConfig(FFN, gemm_backend="te", **kw))
    mod.load_state_dict(ref.state_dict())
    return pt, ref, mod


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_te_experts_own_persistent_grouped_linears(monkeypatch, activation):
    """Protocol (stand-in TE): two GroupedLinear built once for every call, run on views of w13/w2
    with host m_splits; names, state_dict and values/gradients as the loop backend."""
    pt = te_standin.install(monkeypatch)
    ref = build_experts(E, H, ExpertsConfig(FFN, gemm_backend="loop", activation=activation))
    init_parameters(ref, seed=3)
    mod = build_experts(E, H, ExpertsConfig(FFN, gemm_backend="te", activation=activation))
    mod.load_state_dict(ref.state_dict())
    assert [n for n, _ in mod.named_parameters()] == ["w13", "w2"]
    assert list(mod.state_dict()) == list(ref.state_dict())
    fc1, fc2 = pt.GroupedLinear.instances
    assert (fc1.num_gemms, fc1.in_features, fc1.out_features) == (E, H, FFN * (2 if activation == "swiglu" else 1))
    assert (fc2.num_gemms, fc2.in_features, fc2.out_features) == (E, FFN, H)
    assert all(p.is_meta for p in fc1.parameters()), "TE's own weights must hold no storage"
    x, grad = _inputs()
    for step in range(3):
        outs = []
        for m in (ref, mod):
            m.zero_grad()
            xi = x.clone().requires_grad_()
            with HostSyncCounter() as syncs:
                y = m(xi, torch.tensor(COUNTS), tuple(COUNTS))
            assert syncs.total == 0, syncs.report()  # host counts from the dispatcher: no read
            y.backward(grad)
            outs.append((y.detach(), xi.grad, m.w13.grad.clone(), m.w2.grad.clone()))
        for name, a, b in zip(("out", "grad x", "grad w13", "grad w2"), *outs):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=f"step {step} {name}")
    assert len(pt.GroupedLinear.instances) == 2, "TE modules are built once, not per call"
    assert len(fc1.forward_calls) == len(fc2.forward_calls) == 3
    call = fc1.forward_calls[-1]
    assert call["m_splits"] == COUNTS and call["recipe"] is None
    assert all(w._base is mod.w13 for w in call["weights"]), "fc1 must run on views of w13"
    assert all(w._base is mod.w2 for w in fc2.forward_calls[-1]["weights"])
    with HostSyncCounter() as syncs:  # without host counts the experts read them once
        mod(x, torch.tensor(COUNTS))
    assert syncs.total == 1, syncs.report()


@pytest.mark.parametrize(("fmt", "recipe"), [("hybrid", "delayed"), ("e4m3", "tensorwise")])
def test_te_fp8_autocast_and_padding(monkeypatch, fmt, recipe):
    """Protocol (stand-in TE): the experts run in the caller's TE autocast region (precision.fp8_region) with the
    recipe the flags ask for, and refuse to run outside one; rows padded to FP8's per-group alignment once around
    both GEMMs (each row's routing prob padded with it, as Megatron's TEGroupedMLP pads its probs), results and
    the probs' gradient unchanged by padding."""
    from tests.moe.te_standin import DelayedScaling, Float8CurrentScaling, Format, _State

    config = FP8Config(fmt, recipe, backend="te")
    pt, ref, mod = _te_pair(monkeypatch, fp8=config)
    x, grad = _inputs()
    with pytest.raises(RuntimeError, match=r"must run inside precision\.fp8_region\.fp8_autocast"):
        mod(x, torch.tensor(COUNTS), tuple(COUNTS))   # outside a region TE would silently run bf16
    xi, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    probs = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(5))   # padded with the rows (zero)
    pi, pr = probs.clone().requires_grad_(), probs.clone().requires_grad_()
    with fp8_autocast(config):
        y = mod(xi, torch.tensor(COUNTS), tuple(COUNTS), pi)
    y_ref = ref(xr, torch.tensor(COUNTS), None, pr)
    want_recipe = (DelayedScaling if recipe == "delayed" else Float8CurrentScaling)(
        fp8_format=Format.HYBRID if fmt == "hybrid" else Format.E4M3)
    assert _State.entered == [want_recipe], _State.entered
    fc1, fc2 = pt.GroupedLinear.instances
    for gemm in (fc1, fc2):
        (call,) = gemm.forward_calls
        assert call["recipe"] == want_recipe and call["m_splits"] == [16, 0, 16, 16]
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=1e-5)
    y.backward(grad)
    y_ref.backward(grad)
    torch.testing.assert_close(xi.grad, xr.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(mod.w13.grad, ref.w13.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(pi.grad, pr.grad, atol=1e-6, rtol=1e-5)
    assert "fp8 " + fmt in repr(mod)


class _BytesAllocated(TorchDispatchMode):
    """Bytes of the new storages the aten ops under it create (views of existing storages are free)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = pytree.tree_leaves((args, kwargs))
        seen = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
        return out


def test_te_weight_gradients_allocate_one_stack_not_one_weight_per_expert(monkeypatch):
    """TE's per-expert weights are views of the stacked parameter: ``unbind`` (one stack of the e gradients in
    backward), not ``w[i]`` (e SelectBackward nodes, each allocating and adding a zero [e, M, K] tensor: 32x the
    weight's bytes at e = 32). The backward's allocations stay within 3x the weights' bytes."""
    te_standin.install(monkeypatch)
    e, hidden, ffn = 32, 64, 64
    mod = build_experts(e, hidden, ExpertsConfig(ffn, gemm_backend="te"))
    counts = [2] * e
    x = torch.randn(sum(counts), hidden, requires_grad=True)
    y = mod(x, torch.tensor(counts), counts)
    weight_bytes = sum(p.numel() * p.element_size() for p in mod.parameters())
    with _BytesAllocated() as alloc:
        y.backward(torch.ones_like(y))
    assert alloc.bytes < 3 * weight_bytes, f"backward allocated {alloc.bytes / 1e6:.1f} MB ({weight_bytes} B weights)"
    assert mod.w13.grad is not None and mod.w2.grad is not None


def test_te_experts_without_rows_run_the_same_te_calls(monkeypatch):
    """A rank whose experts got no rows runs TE's two GEMMs with zero rows (TE zeroes an empty GEMM's output,
    csrc/extensions/gemm.cpp:535-541), so it issues the TE calls every other rank of the amax group issues;
    its weights get zero gradients (not None)."""
    config = FP8Config("hybrid", "delayed", backend="te")
    pt = te_standin.install(monkeypatch)
    mod = build_experts(E, H, ExpertsConfig(FFN, gemm_backend="te", fp8=config))
    x = torch.zeros(0, H, requires_grad=True)
    with fp8_autocast(config):
        y = mod(x, torch.zeros(E, dtype=torch.long), (0,) * E)
    y.sum().backward()
    fc1, fc2 = pt.GroupedLinear.instances
    assert [c["m_splits"] for c in fc1.forward_calls + fc2.forward_calls] == [[0] * E] * 2
    assert y.shape == (0, H) and all(p.grad is not None and not p.grad.any() for p in mod.parameters())


def test_fp8_refused_where_it_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match=r"gemm backend 'te' .*not 'grouped_mm'; or use --fp8-backend torchao"):
        MoEConfig(num_experts=E, router=RouterConfig(num_experts=E),
                  experts=ExpertsConfig(8, fp8=FP8Config("hybrid", backend="te")))
    with pytest.raises(ValueError, match="--fp8-format='e5m2' is not one of e4m3, hybrid"):
        FP8Config("e5m2")
    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(ImportError, match=r"needs the transformer_engine package.*pip install"):
            build_experts(E, H, ExpertsConfig(FFN, gemm_backend="te", fp8=FP8Config("hybrid", backend="te")))
        with pytest.raises(ImportError, match=r"runs through Transformer Engine.*pip install"):
            FP8Config("hybrid", backend="te").check_available()
    te_standin.install(monkeypatch)
    with pytest.raises(RuntimeError, match=r"cannot run it: Device compute capability 10\.0 or higher required "
                                           r"for MXFP8"):
        build_experts(E, H, ExpertsConfig(FFN, gemm_backend="te", fp8=FP8Config("e4m3", "mxfp8", backend="te")))
    with pytest.raises(ValueError, match=r"gemm backend 'te' \(--moe-grouped-gemm-backend\), not 'grouped_mm'"):
        build_experts(E, H, ExpertsConfig(FFN, gemm_backend="grouped_mm", fp8=FP8Config("e4m3", backend="te")))
    with pytest.raises(ValueError, match=r"gemm backend 'grouped_mm' or 'loop' .*not 'te'; or use --fp8-backend te"):
        build_experts(E, H, ExpertsConfig(FFN, gemm_backend="te", fp8=FP8Config("e4m3")))
