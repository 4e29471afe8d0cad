"""The peers benchmark (``tools.gpu.peers``) on the CPU: its peers compute moefold's layer, and its rows say why.

The parity tests make the GPU ratios mean something: HF's and TorchTitan's blocks, given moefold's weights through
the same mapping the benchmark uses, compute moefold's output in fp32 at a tiny shape of each family (router,
renormalisation, DeepSeek's scaling and expert bias, the experts' gate/up/down layout). The bound is the
first-order rounding of the layer's sums, derived below, not a tolerance tuned to one run.
"""

from __future__ import annotations

import pytest
import torch

from moefold.tools.gpu import peers

FAMILY_SHAPES = {"qwen3_moe": "qwen3_moe:8,2,32,64", "deepseek_v3": "deepseek_v3:8,2,32,64",
                 "mixtral": "mixtral:4,2,32,64"}
T = 48


def _layers(family: str):
    """(config, moefold's fp32 layer with decisive routing, [1, T, H] tokens); DeepSeek with a random expert bias."""
    shape = peers.parse_configs(FAMILY_SHAPES[family])[0]
    config = peers.layer_config(shape)
    torch.manual_seed(0)
    layer = peers.moefold_layer(config, torch.float32, "cpu")
    with torch.no_grad():   # logits of order 1 (init's 0.02 leaves them near-uniform): top-k far from ties
        layer.router.weight.normal_(0.0, 1.0 / shape.H ** 0.5)
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.normal_(0.0, 0.1)
    return config, layer, torch.randn(1, T, shape.H)


def _rounding_bound(config, layer, x_BTH: torch.Tensor) -> torch.Tensor:
    """First-order rounding of y = sum_k p_k W2 (silu(W1 x) * W3 x) between two fp32 implementations, [1, T, H].

    Each length-n sum rounds by about eps sqrt(n) of its terms' magnitudes (random-sign rounding errors; the
    worst case n eps is far looser than any real run). With A = |W1||x|, B = |W3||x| (|silu(g)| <= |g|,
    |silu'| <= 1.1), the SwiGLU products and the down projection move y by eps (sqrt(H) + sqrt(F) + k + 4) M at
    most, M = s max_e |W2_e| (A_e * B_e) (s: the probabilities' largest sum, the scaling factor times 1, or k
    unrenormalised); the logits' rounding eps sqrt(H) L (L = |Wr||x|) moves each probability by at most twice
    that (softmax and sigmoid are 1-Lipschitz per logit), so y by 2 eps sqrt(H) L M. x4 covers the constants."""
    eps = torch.finfo(torch.float32).eps
    r = layer.router.config
    w13, w2 = layer.experts.w13.detach().abs(), layer.experts.w2.detach().abs()
    x = x_BTH[0].abs()
    A, B = torch.einsum("th,efh->etf", x, w13[:, 0]), torch.einsum("th,efh->etf", x, w13[:, 1])
    s = (r.topk_scaling_factor or 1.0) * (1 if r.resolved_norm_topk_prob else r.topk)
    M = s * torch.einsum("etf,ehf->eth", A * B, w2).amax(0)
    L = (x @ layer.router.weight.detach().abs().T).amax(-1, keepdim=True)
    H, F = config.hidden_size, config.moe_ffn_hidden_size
    return (4 * eps * (H ** 0.5 + F ** 0.5 + r.topk + 4 + 2 * H ** 0.5 * L) * M).unsqueeze(0)


def _moefold_out(layer, x_BTH: torch.Tensor) -> torch.Tensor:
    return layer(x_BTH.transpose(0, 1))[0].transpose(0, 1)


@pytest.mark.parametrize("family", sorted(FAMILY_SHAPES))
def test_hf_block_computes_moefolds_layer(family):
    pytest.importorskip("transformers")
    config, layer, x = _layers(family)
    hf = peers.hf_layer(config, layer, torch.float32, "cpu")
    assert hf.experts.config._experts_implementation == "grouped_mm"
    with torch.no_grad():
        y, y_hf = _moefold_out(layer, x), hf(x)
        bound = _rounding_bound(config, layer, x)
    assert y.abs().amax() > 100 * bound.amax()   # the bound is far below the signal: a mapping error shows
    assert ((y - y_hf).abs() <= bound).all(), (y - y_hf).abs().amax()


@pytest.fixture
def histc_of_ids(monkeypatch):
    """TorchTitan 0.2 counts tokens per expert with torch.histc over int64 ids, which only CUDA implements: on the
    CPU count them as floats (exact for small integers) and return the ids' dtype, as the CUDA kernel does."""
    histc = torch.histc

    def counts(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return histc(t, *args, **kwargs) if t.is_floating_point() else histc(t.float(), *args, **kwargs).to(t.dtype)

    monkeypatch.setattr(torch, "histc", counts)


@pytest.mark.parametrize("family", sorted(FAMILY_SHAPES))
def test_torchtitan_layer_computes_moefolds_layer(family, histc_of_ids):
    config, layer, x = _layers(family)
    try:   # its per-expert loop: exact fp32 (the grouped path casts to bf16)
        titan = peers.titan_layer(config, layer, torch.float32, "cpu", grouped_mm=False)
    except peers.Unavailable as why:
        pytest.skip(f"TorchTitan's layer: {why}")
    with torch.no_grad():
        y, y_titan = _moefold_out(layer, x), titan(x)
        bound = _rounding_bound(config, layer, x)
    assert ((y - y_titan).abs() <= bound).all(), (y - y_titan).abs().amax()


def _rows(text: str) -> list[list[str]]:
    lines = [ln for ln in text.splitlines() if ln.startswith("|") and not ln.startswith("|---")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[1:]]


def _is_number(cell: str) -> bool:
    try:
        return float(cell) >= 0
    except ValueError:
        return False


def test_layer_rehearsal_prints_one_row_per_shape(capsys):
    assert peers.main(["layer", "--device", "cpu", "--iters", "1", "--warmup", "0"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert [r[0].split()[0] for r in rows] == ["qwen3_moe", "deepseek_v3", "mixtral"]
    for shape, mine, hf, titan, vs_hf, _vs_titan, rate, dense, ratio in rows:
        assert all(_is_number(c) for c in (mine, rate, dense, ratio)), shape
        assert (_is_number(hf) and _is_number(vs_hf)) or hf == "not installed: transformers"
        assert titan.startswith(("not installed: torchtitan", "not importable:", "API missing:", "CUDA only:"))


def test_step_rehearsal_prints_its_row(capsys):
    pytest.importorskip("transformers")
    assert peers.main(["step", "--device", "cpu", "--iters", "1", "--warmup", "0", "--seq", "16"]) == 0
    (row,) = _rows(capsys.readouterr().out)
    assert row[0] == "qwen3_moe_tiny B2 S16" and row[1] == "32"
    assert _is_number(row[2]) and _is_number(row[3]) and _is_number(row[5])
    assert row[4].startswith("not built:")


def test_a_peer_that_raises_fails_the_row_and_the_exit_code(capsys, monkeypatch):
    def boom(*_args, **_kwargs):
        raise RuntimeError("boom")

    def oom(*_args, **_kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(peers, "hf_layer", boom)
    monkeypatch.setattr(peers, "titan_layer", oom)
    args = ["layer", "--device", "cpu", "--configs", FAMILY_SHAPES["mixtral"], "--iters", "1", "--warmup", "0"]
    assert peers.main(args) == 1
    (row,) = _rows(capsys.readouterr().out)
    assert _is_number(row[1]) and row[2] == "failed: RuntimeError: boom" and row[3] == "OOM"
    assert row[4] == row[5] == "-"


def test_without_cuda_it_says_so():
    if not torch.cuda.is_available():
        assert peers.main(["layer"]) == 2 and peers.main(["step"]) == 2


def test_past_the_deadline_rows_say_so(capsys):
    assert peers.main(["layer", "--device", "cpu", "--deadline", "0"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert len(rows) == 3 and all(r[1] == "skipped: out of time (--deadline 0 s)" for r in rows)


@pytest.mark.parametrize("spec, message", [
    ("qwen2:8,2,32,64", "family 'qwen2'"), ("mixtral:8,2,32", "four positive integers"),
    ("mixtral:4,8,32,64", "top-k 8 exceeds the 4 experts")])
def test_bad_configs_name_the_value(spec, message):
    with pytest.raises(ValueError, match=message):
        peers.parse_configs(spec)
