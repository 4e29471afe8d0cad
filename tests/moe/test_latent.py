"""Latent experts (``--moe-latent-size``): the layer equals down-projection -> experts at the latent width ->
up-projection, written out here from the layer's own parts; the widths and parameters are Megatron's; a bad
projection pair is refused. Layouts equal world 1 in tests/moe/test_moe_layer.py (``latent`` cases)."""

from __future__ import annotations

import pytest
import torch

from moefold.moe.build import build_moe_layer
from moefold.moe.config import ExpertsConfig, MoEConfig, SharedExpertsConfig
from moefold.moe.latent import LatentProjection
from moefold.moe.layer import MoELayer
from moefold.moe.router_config import RouterConfig
from moefold.parallel.dims import ParallelDims
from moefold.parallel.sharding import init_parameters, is_sequence_parallel

H, L, F, E, K, T = 32, 8, 16, 4, 2, 24


def _config(latent: int | None = L, **router) -> MoEConfig:
    return MoEConfig(num_experts=E, router=RouterConfig(num_experts=E, topk=K, init_std=0.3, **router),
                     experts=ExpertsConfig(F, init_std=0.3), shared=SharedExpertsConfig(16, init_std=0.3),
                     latent_size=latent)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_layer_equals_its_definition(dtype: torch.dtype) -> None:
    layer = build_moe_layer(_config(), H, ParallelDims.single(), dtype=dtype)
    init_parameters(layer, seed=3)
    x = torch.randn(T, 1, H, generator=torch.Generator().manual_seed(0)).to(dtype)
    y, _ = layer(x)
    with torch.no_grad():
        routed = layer.router(x.view(T, H))
        down = layer.latent_down(x.view(T, H))                                   # [T, L]
        every = layer.experts(down.repeat(E, 1), torch.full((E,), T), [T] * E).view(E, T, L)
        ids, probs = routed.routing.expert_ids_TK, routed.routing.probs_TK
        picked = every[ids, torch.arange(T)[:, None]]                            # [T, K, L]
        lat = (probs[..., None] * picked.float()).sum(1)
        ref = (layer.latent_up(lat).float() + layer.shared_experts(x).view(T, H).float()).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y.view(T, H), ref, **tol)
    assert layer.experts.hidden_size == L
    assert layer.latent_down.weight.shape == (L, H) and layer.latent_up.weight.shape == (H, L)
    assert is_sequence_parallel(layer.latent_down.weight) and is_sequence_parallel(layer.latent_up.weight)


def test_latent_parameters_and_meta_build() -> None:
    full = build_moe_layer(_config(latent=None), H, ParallelDims.single(), device="meta")
    lat = build_moe_layer(_config(), H, ParallelDims.single(), device="meta")
    count = lambda m, pre: sum(p.numel() for n, p in m.named_parameters() if n.startswith(pre))
    # experts: E x (gate+up [2F, width] + down [width, F]); latent adds [L, H] + [H, L]
    assert count(full, "experts") == E * 3 * F * H and count(lat, "experts") == E * 3 * F * L
    assert count(lat, "latent") == 2 * L * H and count(full, "latent") == 0
    assert all(p.is_meta for p in lat.parameters())
    assert count(lat, "router") == count(full, "router") == E * H   # the router sees the full width


def test_latent_refusals() -> None:
    with pytest.raises(ValueError, match="latent_size"):
        _config(latent=0)
    layer = build_moe_layer(_config(), H, ParallelDims.single())
    with pytest.raises(ValueError, match="do not map hidden size 32"):
        MoELayer(layer.router, layer.dispatcher, layer.experts,
                 latent=(LatentProjection(H, L, 0.1), LatentProjection(L, H + 1, 0.1)))
    with pytest.raises(ValueError, match="the experts take width 8, the tokens reach them at 32"):
        MoELayer(layer.router, layer.dispatcher, layer.experts)
