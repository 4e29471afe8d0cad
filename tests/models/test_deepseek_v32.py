"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) and GLM-5 (``GlmMoeDsaForCausalLM``: its indexer's RoPE interleaved):
DeepSeek sparse attention against transformers, each test for both families.

- world 1: logits of a tiny random checkpoint (5 or 6 of 16 tokens kept per query) equal transformers', the export
  is bit-exact and reloads in transformers; negative controls: the same weights attending densely, with the other
  family's indexer RoPE, or with the indexer's keys unnormalised, give other logits
  (tests/models/test_random_configs.py draws configs at random over the indexer's sizes and top-k, at world 1, tp2,
  ep2 and tp2 x ep2);
- every gradient but the indexer's equals transformers' autograd (its indexer is under ``no_grad``), and the
  indexer's equals the gradient of an independent float64 reference of DeepSeek's KL loss built from transformers'
  own attention probabilities and modules;
- layouts, in ONE 4-rank world: logits at tp2 (SP and not), ep2, pp2, cp2 and tp2 x cp2 x ep2; the loss and every
  gradient (the indexer's included) equal world 1's at tp2, cp2 x dp2 and tp2 x cp2 x ep2;
- greedy generation through the latent caches equals transformers' ``generate`` (tests/models/test_generate.py);
- the recipes round-trip through HF configs and transformers' config classes.
"""

from __future__ import annotations

import time

import pytest
import torch

from moefold.models.decoder import MoEDecoder
from moefold.models.hf.exporter import export_hf, hf_tensors
from moefold.models.hf.importer import import_hf, load_config
from moefold.models.options import ModelOptions
from tests.distributed import LayoutDims, run_distributed
from tests.models.hf_tiny import hf_logits, save_hf, tokens
from tests.models.test_families_parallel import _batch, _grads, _logits, _reference_grads
from tests.tolerance import assert_within_fp32_noise

transformers = pytest.importorskip("transformers")

TOL = 1e-5
FAMILIES = ("deepseek_v32", "glm_moe_dsa")


def _tensors(path) -> dict[str, torch.Tensor]:
    from moefold.models.tensor_io import TensorReader

    with TensorReader(path) as r:
        return {n: r.read(n) for n in r.names()}


def _set_dsa(model, **changes) -> None:
    """Change every DSA layer's indexer settings in place (a negative control)."""
    for block in model.layers.values():
        attn = block.self_attn
        attn.dsa = attn.indexer.config = type(attn.dsa)(**{**vars(attn.dsa), **changes})


@pytest.mark.parametrize("family", FAMILIES)
def test_world_1_parity_export_and_negative_controls(family, tmp_path):
    src, out = tmp_path / "hf", tmp_path / "out"
    hf = save_hf(family, src)
    ids = tokens()
    ref = hf_logits(hf, ids)
    model = import_hf(src)
    diff = (model.logits(ids) - ref).abs().max().item()
    print(f"{family} world 1: max |logits diff| = {diff:.3g}")
    assert diff <= TOL
    export_hf(model, out)
    a, b = _tensors(src), _tensors(out)
    assert sorted(a) == sorted(b) and any(".indexer." in n for n in a)
    assert all(torch.equal(a[n], b[n]) for n in a)
    reloaded = type(hf).from_pretrained(out).eval()
    torch.testing.assert_close(hf_logits(reloaded, ids), ref, atol=TOL, rtol=0)
    # negative controls: every key attended (the selection matters), the other family's indexer RoPE, the indexer
    # keys without their LayerNorm
    interleave = model.config.dsa.rope_interleave
    assert interleave == (family == "glm_moe_dsa") and model.config.dsa.index_topk < 8
    for changes in ({"index_topk": 16}, {"rope_interleave": not interleave}):
        other = import_hf(src)
        _set_dsa(other, **changes)
        assert (other.logits(ids) - ref).abs().max().item() > 1e-3, changes
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("indexer.k_norm.weight"):
                p.fill_(1.0)
    assert (model.logits(ids) - ref).abs().max().item() > 1e-3


def _reference_indexer_loss(hf, ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3.2's indexer loss (sparse stage), summed over layers, from transformers' model in float64: the
    target is its eager attention's probabilities (over the keys its indexer kept) summed over heads and
    L1-normalised; the prediction a dense softmax of index scores recomputed here from the indexer's modules."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    rope = apply_rotary_pos_emb_interleave if type(hf).__name__.startswith("Glm") else apply_rotary_pos_emb

    hf.config._attn_implementation = "eager"
    out = hf(input_ids=ids, output_attentions=True, output_hidden_states=True)
    B, S = ids.shape
    pos = torch.arange(S)[None]
    causal = torch.arange(S)[:, None] >= torch.arange(S)[None, :]   # [S(q), S(k)]
    total = torch.zeros((), dtype=torch.float64)
    for layer, (h, probs) in enumerate(zip(out.hidden_states, out.attentions)):
        block = hf.model.layers[layer]
        attn, idx_mod = block.self_attn, block.self_attn.indexer
        x = block.input_layernorm(h).detach()
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x)).detach()
        cos, sin = hf.model.rotary_emb(x, pos)
        topk = idx_mod(x, q_resid, (cos, sin), causal[None].expand(B, S, S), pos).long()   # HF's own selection
        n, d, r = idx_mod.n_heads, idx_mod.head_dim, idx_mod.qk_rope_head_dim
        q = idx_mod.wq_b(q_resid).view(B, S, n, d)
        k = idx_mod.k_norm(idx_mod.wk(x))[:, :, None]
        q_rot, k_rot = rope(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
        q, k = torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1)[:, :, 0]
        scores = torch.relu(torch.einsum("bsnd,btd->bsnt", q, k) * d ** -0.5)
        index = torch.einsum("bsn,bsnt->bst", idx_mod.weights_proj(x) * n ** -0.5, scores)
        kept = torch.zeros(B, S, S, dtype=torch.bool).scatter(-1, topk, True) & causal
        target = probs.detach().sum(1).masked_fill(~kept, 0)
        target = target / target.sum(-1, keepdim=True)
        log_q = torch.log_softmax(index.masked_fill(~kept, float("-inf")), -1).masked_fill(~kept, 0)
        kl = torch.where(kept, target * (torch.log(target.clamp_min(1e-300)) - log_q), 0.0)
        total = total + kl.sum() / (B * S)
    return total


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_and_indexer_loss_equal_transformers(family, tmp_path):
    hf = save_hf(family, tmp_path)
    hf.config._attn_implementation = "sdpa"
    ids, labels = tokens(seed=5), tokens(seed=6)
    logits = hf(input_ids=ids).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    config = load_config(tmp_path).with_(moe_aux_loss_coeff=0.0)   # HF's loss has no balancing term here
    model = MoEDecoder(config)
    with torch.no_grad():
        for name, tensor in import_hf(tmp_path).state_dict().items():
            model.state_dict()[name].copy_(tensor)
    model(ids, labels).loss.backward()
    worst, indexer = 0.0, {}
    for name, p in model.named_parameters():
        for hf_name, grad in hf_tensors(name, p.grad, config, expert_format="fused"):
            if ".indexer." in name:   # HF's indexer runs under no_grad: its gradient is the KL loss's below
                assert hf_name not in hf_grads
                indexer[hf_name] = grad
                continue
            worst = max(worst, (grad - hf_grads[hf_name]).abs().max().item())
            torch.testing.assert_close(grad, hf_grads[hf_name], atol=1e-6, rtol=1e-4, msg=lambda m: f"{hf_name}: {m}")
    print(f"{family} world 1: max |grad diff| (all but the indexer) = {worst:.3g}")
    assert len(indexer) == 5 * config.num_layers   # wq_b, wk, k_norm weight and bias, weights_proj
    # the indexer: its KL loss (coefficient 1) in an independent float64 reference
    hf64 = hf.double()
    hf64.config._experts_implementation = "eager"   # torch._grouped_mm has no float64
    hf64.zero_grad()
    _reference_indexer_loss(hf64, ids).backward()
    ref = {n: p.grad for n, p in hf64.named_parameters() if ".indexer." in n}
    worst = max(((indexer[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in indexer)
    print(f"{family} world 1: indexer gradients, max relative diff to the float64 reference = {worst:.3g}")
    assert worst <= 1e-4


LOGIT_LAYOUTS = [("tp2", dict(tp=2), {}), ("tp2 no-SP", dict(tp=2), dict(sequence_parallel=False)),
                 ("ep2", dict(ep=2), {}), ("pp2", dict(pp=2), {}), ("cp2", dict(cp=2), {}),
                 ("tp2xcp2xep2", dict(tp=2, cp=2, ep=2), {})]
GRAD_LAYOUTS = [("tp2", dict(tp=2), {}), ("cp2xdp2", dict(cp=2), {}), ("tp2xcp2xep2", dict(tp=2, cp=2, ep=2), {})]


def _rank(paths: dict[str, str], refs: dict[str, torch.Tensor], ids: torch.Tensor):
    report, start, dims_for = {}, time.perf_counter(), LayoutDims()


    for family, path in paths.items():
        for label, par, opts in LOGIT_LAYOUTS:
            logits = _logits(path, dims_for(par), ModelOptions(**opts), ids)
            if logits is not None:
                report[f"{family} {label}"] = (logits - refs[family]).abs().max().item()
        ref_losses, mb_grads, mb_grads64 = _reference_grads(path, 4)
        for label, par, opts in GRAD_LAYOUTS:
            dims = dims_for(par)
            total, grads = _grads(path, dims, ModelOptions(**opts))
            torch.testing.assert_close(total, ref_losses[dims.dp_rank], atol=1e-6, rtol=1e-6)
            ref32, ref64 = ({n: sum(mb[r][n] for r in range(dims.dp)) / dims.dp for n in mb[0]}
                            for mb in (mb_grads, mb_grads64))
            assert any(".indexer." in n for n in grads)
            report[f"{family} grads {label}"] = assert_within_fp32_noise(grads, ref32, ref64, f"{family} {label}")
    report["seconds"] = time.perf_counter() - start
    return report


def test_layouts_equal_transformers_and_world_1(tmp_path):
    ids = tokens(seq=16)
    paths = {f: str(tmp_path / f) for f in FAMILIES}
    refs = {f: hf_logits(save_hf(f, paths[f]), ids) for f in FAMILIES}
    reports = run_distributed(_rank, 4, paths, refs, ids, timeout=600)
    report = {}
    for r in reports:
        for key, value in r.items():
            report[key] = max(report.get(key, 0.0), value)
    for key, value in report.items():
        print(f"{key}: {value:.3g}")
    for family in FAMILIES:
        for label, _, _ in LOGIT_LAYOUTS:
            assert report[f"{family} {label}"] <= TOL, (family, label)
    assert _batch(0)[0].shape == (2, 16)


@pytest.mark.parametrize("name", ["deepseek_v32", "deepseek_v32_tiny", "deepseek_v32_proxy", "glm5", "glm5_tiny"])
def test_recipes_roundtrip_through_hf_config(name):
    from moefold.models.hf.config_map import from_hf_config, to_hf_config
    from moefold.models.recipes import get_recipe

    recipe = get_recipe(name)
    if name == "glm5":   # GLM-5's published config.json: default RoPE at theta 1e6 (the HF class's default is 1e4)
        assert (recipe.rope_theta, recipe.yarn) == (1e6, None)
    hf = to_hf_config(recipe)
    assert from_hf_config(hf, name=name) == recipe
    # transformers' own config class takes the export and gives it back unchanged
    cls = getattr(transformers, hf["architectures"][0].replace("ForCausalLM", "Config"))
    own = cls(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")}).to_dict()
    assert from_hf_config({**own, "architectures": hf["architectures"]}, name=name) == recipe
