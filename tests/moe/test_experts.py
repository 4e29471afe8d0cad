"""GroupedExperts: loop reference, init independent of layout, etp/ep shards equal world 1."""

import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moefold.moe.config import MoEConfig
from moefold.moe.experts import GroupedExperts
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelConfig, ParallelDims
from moefold.parallel.fp8 import FP8Config
from moefold.parallel.sharding import gather_full, init_parameters, shards_of
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
    experts = GroupedExperts(E, H, FFN, activation=activation, gemm_backend=backend)
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
        GroupedExperts(E, H, FFN, activation="relu")
    with pytest.raises(ValueError, match="gemm_backend='x'"):
        GroupedExperts(E, H, FFN, gemm_backend="x")


def _sharded_vs_world1():
    torch.manual_seed(0)
    x, grad = _inputs()
    starts = [sum(COUNTS[:i]) for i in range(E)]
    ref = GroupedExperts(E, H, FFN)
    init_parameters(ref, seed=5)
    ref_out = ref(x, torch.tensor(COUNTS))
    ref_out.backward(grad)
    for cfg in (ParallelConfig(ep=2, etp=2), ParallelConfig(ep=4), ParallelConfig(etp=4), ParallelConfig(ep=1)):
        dims = ParallelDims.build(cfg)
        mod = GroupedExperts(E, H, FFN, ep_group=dims.ep_group, etp_group=dims.etp_group)
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
    ref = GroupedExperts(E, H, FFN, gemm_backend="loop")
    init_parameters(ref, seed=3)
    mod = GroupedExperts(E, H, FFN, gemm_backend="te", **kw)
    mod.load_state_dict(ref.state_dict())
    return pt, ref, mod


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_te_experts_own_persistent_grouped_linears(monkeypatch, activation):
    """Protocol (stand-in TE): two GroupedLinear built once for every call, run on views of w13/w2
    with host m_splits; names, state_dict and values/gradients as the loop backend."""
    pt = te_standin.install(monkeypatch)
    ref = GroupedExperts(E, H, FFN, gemm_backend="loop", activation=activation)
    init_parameters(ref, seed=3)
    mod = GroupedExperts(E, H, FFN, gemm_backend="te", activation=activation)
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
    """Protocol (stand-in TE): one TE autocast per experts call with the recipe the flags ask for,
    rows padded to FP8's per-group alignment once around both GEMMs, results unchanged by padding."""
    from tests.moe.te_standin import DelayedScaling, Float8CurrentScaling, Format, _State

    pt, ref, mod = _te_pair(monkeypatch, fp8=FP8Config(fmt, recipe, backend="te"))
    x, grad = _inputs()
    xi, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = mod(xi, torch.tensor(COUNTS), tuple(COUNTS))
    y_ref = ref(xr, torch.tensor(COUNTS))
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
    assert "fp8 " + fmt in repr(mod)


def test_fp8_refused_where_it_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match=r"gemm backend 'te' .*not 'grouped_mm'; or use --fp8-backend torchao"):
        MoEConfig(num_experts=E, moe_ffn_hidden_size=8, router=RouterConfig(num_experts=E),
                  fp8=FP8Config("hybrid", backend="te"))
    with pytest.raises(ValueError, match="--fp8-format='e5m2' is not one of e4m3, hybrid"):
        FP8Config("e5m2")
    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(ImportError, match=r"needs the transformer_engine package.*pip install"):
            GroupedExperts(E, H, FFN, gemm_backend="te", fp8=FP8Config("hybrid", backend="te"))
        with pytest.raises(ImportError, match=r"runs through Transformer Engine.*pip install"):
            FP8Config("hybrid", backend="te").check_available()
    te_standin.install(monkeypatch)
    with pytest.raises(RuntimeError, match=r"cannot run it: MXFP8 needs compute capability 10\.0"):
        GroupedExperts(E, H, FFN, gemm_backend="te", fp8=FP8Config("e4m3", "mxfp8", backend="te"))
    with pytest.raises(ValueError, match=r"gemm backend 'te' \(--moe-grouped-gemm-backend\), not 'grouped_mm'"):
        GroupedExperts(E, H, FFN, gemm_backend="grouped_mm", fp8=FP8Config("e4m3", backend="te"))
    with pytest.raises(ValueError, match=r"gemm backend 'grouped_mm' or 'loop' .*not 'te'; or use --fp8-backend te"):
        GroupedExperts(E, H, FFN, gemm_backend="te", fp8=FP8Config("e4m3"))
