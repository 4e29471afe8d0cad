"""Packed samples and their documents run one by one: the reference of the packed-document tests."""

from __future__ import annotations

import torch

from moefold.dense.documents import packed_documents
from moefold.models.decoder import MoEDecoder
from moefold.models.recipes import get_recipe

EOD = 1
SEQ = 32
# per sample, its documents' lengths (the last one runs off the sample's end: no EOD); 16 + 1 + 15, 5 + 3 + 24, ...
LENGTHS = ((16, 1, 15), (5, 3, 11, 13))
# three families: sliding window + attention sinks + GQA + YaRN (gpt_oss), MLA + YaRN (deepseek_v3, no MTP: its
# shifted predictions cross documents), Gated DeltaNet + gated attention (qwen3_next); no aux losses (they couple
# the batch's tokens)
FAMILIES = {
    "gpt_oss_tiny": {"moe_aux_loss_coeff": 0.0},
    "deepseek_v3_tiny": {"num_layers": 2, "mtp_num_layers": 0, "moe_aux_loss_coeff": 0.0},
    "qwen3_next_tiny": {"moe_aux_loss_coeff": 0.0},
}


def config(name: str):
    return get_recipe(name).with_(**FAMILIES[name])


def packed_tokens(seed: int = 0, vocab: int = 512) -> torch.Tensor:
    """``[B, SEQ + 1]`` samples: documents of ``LENGTHS`` (each ended by ``EOD`` but the last), one more token."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for lengths in LENGTHS:
        assert sum(lengths) == SEQ
        row = torch.randint(2, vocab, (SEQ + 1,), generator=g)
        for end in torch.tensor(lengths).cumsum(0)[:-1].tolist():
            row[end - 1] = EOD
        rows.append(row)
    return torch.stack(rows)


def inputs(tokens: torch.Tensor, cp_rank: int = 0, cp: int = 1, *, reset_position_ids: bool = True):
    """(ids, labels, loss mask, documents) of whole samples (``--eod-mask-loss``), CP rank ``cp_rank``'s part."""
    from moefold.dense.context_parallel import split_for_context_parallel

    ids, labels = tokens[:, :-1], tokens[:, 1:]
    mask = (ids != EOD).float()
    docs = packed_documents(ids, EOD, reset_position_ids=reset_position_ids, reset_attention_mask=True,
                            cp_rank=cp_rank, cp=cp)
    ids, labels, mask = (split_for_context_parallel(t, cp_rank, cp, seq_dim=1).contiguous()
                         for t in (ids, labels, mask))
    return ids, labels, mask, docs


def one_by_one(model: MoEDecoder, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each document of each sample run alone (B = 1, positions from 0, no documents): (logits ``[B, S, V]``
    assembled in packed order, the packed batch's loss: every document's masked loss sum over all tokens)."""
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    mask = (ids != EOD).float()
    logits = torch.empty(*ids.shape, model.config.vocab_size, dtype=torch.float32)
    total, count = 0.0, mask.sum()
    for b, lengths in enumerate(LENGTHS):
        start = 0
        for n in lengths:
            rows = slice(start, start + n)
            logits[b, rows] = model.logits(ids[b:b + 1, rows])[0]
            out = model(ids[b:b + 1, rows], labels[b:b + 1, rows], mask[b:b + 1, rows])
            total = total + out.loss * mask[b, rows].sum().clamp(min=1) / count
            start += n
    return logits, total
