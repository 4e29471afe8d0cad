"""Mamba-2's SSD scan (dense/ssd_scan.py): the chunked form equals the token-by-token recurrence (float64, every
chunk size, with groups, D and an initial state), a sequence scanned in two pieces equals one pass, gradients
agree, and transformers' own torch scan (``NemotronHMamba2Mixer``'s ``mamba2_chunk_scan``) gives the same."""

from __future__ import annotations

import pytest
import torch

from moefold.dense.ssd_scan import ssd_chunk_scan, ssd_recurrent


def _inputs(seed: int, b=2, s=13, h=4, p=3, g=2, n=5, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype)
    dt = torch.nn.functional.softplus(r(b, s, h) - 1.0)
    A = -torch.exp(0.5 * r(h))
    return dict(x=r(b, s, h, p), dt=dt, A=A, B=r(b, s, g, n), C=r(b, s, g, n), D=r(h))


@pytest.mark.parametrize("chunk", [1, 4, 5, 13, 16])
def test_chunked_equals_recurrence(chunk):
    for seed in range(3):
        args = _inputs(seed)
        init = torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        y_ref, s_ref = ssd_recurrent(**args, initial_state=init)
        y, s = ssd_chunk_scan(**args, chunk_size=chunk, initial_state=init)
        torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(s, s_ref, atol=1e-12, rtol=1e-10)


def test_two_pieces_equal_one_pass_and_gradients():
    args = _inputs(4, s=20)
    y, state = ssd_chunk_scan(**args, chunk_size=8)
    first = {k: (v[:, :7] if v.dim() > 1 else v) for k, v in args.items()}
    rest = {k: (v[:, 7:] if v.dim() > 1 else v) for k, v in args.items()}
    y1, s1 = ssd_chunk_scan(**first, chunk_size=8)
    y2, s2 = ssd_chunk_scan(**rest, chunk_size=8, initial_state=s1)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), y, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(s2, state, atol=1e-12, rtol=1e-10)
    leaves = {k: v.clone().requires_grad_() for k, v in args.items()}
    grads = []
    for fn in (lambda **a: ssd_recurrent(**a)[0], lambda **a: ssd_chunk_scan(**a, chunk_size=6)[0]):
        out = fn(**leaves)
        grads.append(torch.autograd.grad((out * out.detach().sin()).sum(), list(leaves.values())))
    for name, a, b in zip(leaves, *grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8, msg=name)


def test_matches_transformers_torch_scan():
    nemotron = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    for seed, chunk in ((0, 4), (1, 16)):
        a = _inputs(seed, dtype=torch.float32)
        ref, ref_state = nemotron.mamba2_chunk_scan(a["x"], a["dt"], a["A"], a["B"], a["C"], chunk, D=a["D"],
                                                    return_final_states=True)
        y, state = ssd_chunk_scan(**a, chunk_size=chunk)
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_named():
    a = _inputs(0)
    with pytest.raises(ValueError, match=r"4 heads do not split into 3 groups"):
        ssd_chunk_scan(**{**a, "B": a["B"][:, :, :1].expand(-1, -1, 3, -1),
                          "C": a["C"][:, :, :1].expand(-1, -1, 3, -1)}, chunk_size=4)
    with pytest.raises(ValueError, match=r"chunk_size=0 must be a positive integer"):
        ssd_chunk_scan(**a, chunk_size=0)
