"""DeepSeek-V3 multi-token prediction: the model's MTP loss and all gradients equal a direct computation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moefold.models.decoder import MoEDecoder
from moefold.models.recipes import deepseek_v3_tiny


def _direct_loss(model: MoEDecoder, ids, labels, mask):
    """LM + MoE aux + scaling * mean_k L_k, written out with batch-first shifts and F.cross_entropy."""
    cfg = model.config
    B, S = ids.shape
    pos = torch.arange(S)
    h, infos = model.run_layers(model.embed_tokens(ids.t()), pos)
    aux = sum(info.aux_loss for info in infos.values())

    def ce(hidden, lab, msk):
        logits = model.output_head(hidden).transpose(0, 1)  # [B, S, V]
        tok = F.cross_entropy(logits.reshape(B * S, -1), lab.reshape(-1), reduction="none").view(B, S)
        return (tok * msk).sum() / msk.sum()

    h = model.norm(h)   # Megatron-Core's convention: MTP depth 1 reads the normalised hidden state
    lm = ce(h, labels, mask)
    mtp_losses = []
    for k, module in enumerate(model.mtp, start=1):
        shift = lambda t: torch.cat([t[:, k:], torch.zeros_like(t[:, :k])], dim=1)  # t_{i+k}, zeros past the end
        emb = model.embed_tokens(shift(ids).t())
        x = module.eh_proj(torch.cat([module.enorm(emb), module.hnorm(h)], dim=-1))
        h, extra = module.block(x, pos)
        aux = aux + extra.aux_loss
        h = module.final_layernorm(h)   # the next depth reads this depth's normalised output
        mtp_losses.append(ce(h, shift(labels), shift(mask)))
    mtp = torch.stack(mtp_losses).mean()
    return lm + aux + cfg.mtp_loss_scaling_factor * mtp, lm, mtp


def test_mtp_loss_and_gradients_equal_direct_computation():
    cfg = deepseek_v3_tiny().with_(num_layers=2, mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
    model = MoEDecoder(cfg)
    model.init_weights(3)
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, cfg.vocab_size, (2, 12), generator=g), torch.randint(0, cfg.vocab_size, (2, 12),
                                                                                           generator=g)
    mask = (torch.rand(2, 12, generator=g) > 0.3).float()
    params = [p for p in model.parameters()]

    out = model(ids, labels, mask)
    grads = torch.autograd.grad(out.loss, params)
    loss, lm, mtp = _direct_loss(model, ids, labels, mask)
    expected = torch.autograd.grad(loss, params)

    torch.testing.assert_close(out.loss, loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.lm_loss, lm.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.mtp_loss, mtp.detach(), atol=1e-6, rtol=1e-6)
    assert out.mtp_loss > 0 and set(out.losses) >= {"lm", "mtp", "mtp_1", "mtp_2", "moe/seq_aux_loss"}
    assert set(out.moe) == {1, 2, 3}  # MoE layer 1 and the two MTP blocks (layers 2, 3)
    for (name, _), a, b in zip(model.named_parameters(), grads, expected):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # the MTP modules receive gradient (the test would notice an MTP branch cut from the loss)
    assert all(g.abs().sum() > 0 for (n, _), g in zip(model.named_parameters(), grads) if n.startswith("mtp.0.eh"))
