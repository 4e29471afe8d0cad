"""Documents inside packed samples: where each one starts, and the positions that restart with it.

A packed sample holds several documents back to back, each ended by the end-of-document (EOD) token. Megatron's
``--reset-attention-mask`` keeps attention inside each document, ``--reset-position-ids`` restarts the positions at
each document's first token (Megatron-Core ``gpt_dataset._get_ltor_masks_and_position_ids``: the token after an
EOD opens a new document, so the EOD belongs to the document it ends). ``Documents`` is what the model's forward
takes for that: the documents' start offsets per sample on the host (the kernels' block lists are planned from
them, with no device synchronisation), and the restarted positions of this rank's tokens.

Context parallelism splits a sample as it splits any sequence (``dense.context_parallel``: chunks ``r`` and
``2cp-1-r`` of ``2cp``); ``starts`` stay the whole sample's (every rank plans its own blocks from them), the
positions are split with the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import Tensor

from moefold.dense.context_parallel import split_for_context_parallel


@dataclass(frozen=True)
class Documents:
    """The documents of a batch of packed samples.

    ``starts``: per sample (batch row), the global offsets where its documents start, increasing, the first 0
    (host ints). ``seq_length``: the whole sample's length ``S`` (before any CP split). ``isolate``: attention and
    the recurrent mixers stay inside each document (``--reset-attention-mask``). ``positions``: ``[B, S_local]``
    int64, the restarted position of each of this rank's tokens (``--reset-position-ids``; what RoPE reads), or
    None to keep the global positions. Nothing here crosses ranks."""

    starts: tuple[tuple[int, ...], ...]
    seq_length: int
    isolate: bool = True
    positions: Tensor | None = None

    def __post_init__(self) -> None:
        S = self.seq_length
        for b, row in enumerate(self.starts):
            if not row or row[0] != 0 or any(not a < c for a, c in pairwise(row)) or row[-1] >= S:
                raise ValueError(f"Documents: starts[{b}]={row} must increase from 0 and stay below seq_length={S}")
        if self.positions is not None and (self.positions.dim() != 2 or self.positions.shape[0] != len(self.starts)):
            raise ValueError(f"Documents: positions {tuple(self.positions.shape)} must be [B={len(self.starts)}, "
                             "S_local]")

    @property
    def batch(self) -> int:
        return len(self.starts)

    def segments(self, b: int) -> list[tuple[int, int]]:
        """The ``[start, end)`` global ranges of sample ``b``'s documents."""
        row = self.starts[b]
        return list(zip(row, (*row[1:], self.seq_length)))

    def document_ids(self, position_ids: Tensor) -> Tensor:
        """``[B, S]`` int64: the index, within its sample, of the document holding each global position of
        ``position_ids [S]`` (positions past the sample's end: its last document)."""
        starts = [torch.tensor(row).to(position_ids.device, non_blocking=True) for row in self.starts]
        return torch.stack([torch.searchsorted(row, position_ids, right=True) - 1 for row in starts])

    def rope_positions(self, position_ids: Tensor, batch: int) -> Tensor:
        """What RoPE reads: ``position_ids [S]`` (global), or the restarted ``[S, B]`` ones."""
        if self.positions is None:
            return position_ids
        if self.positions.shape != (batch, position_ids.shape[0]):
            raise ValueError(f"Documents: positions {tuple(self.positions.shape)} must be [{batch}, "
                             f"{position_ids.shape[0]}] (this rank's tokens)")
        return self.positions.t()


def document_starts(tokens_BS: Tensor, eod: int) -> tuple[tuple[int, ...], ...]:
    """Per sample, where documents start in ``tokens [B, S]`` (CPU): at 0 and after every EOD but a last one."""
    if tokens_BS.dim() != 2:
        raise ValueError(f"document_starts: tokens must be [B, S], got {tuple(tokens_BS.shape)}")
    S = tokens_BS.shape[1]
    ends = (tokens_BS[:, :-1] == eod).nonzero().tolist()   # an EOD at the last token opens nothing
    starts: list[list[int]] = [[0] for _ in range(tokens_BS.shape[0])]
    for b, i in ends:
        starts[b].append(i + 1)
    assert all(row[-1] < S for row in starts)
    return tuple(tuple(row) for row in starts)


def restarted_positions(starts: tuple[tuple[int, ...], ...], seq_length: int) -> Tensor:
    """``[B, S]`` int64: each token's offset inside its document (Megatron's reset position ids)."""
    pos = torch.arange(seq_length).repeat(len(starts), 1)
    for b, row in enumerate(starts):
        for start, end in zip(row, (*row[1:], seq_length)):
            pos[b, start:end] -= start
    return pos


def packed_documents(tokens_BS: Tensor, eod: int, *, reset_position_ids: bool, reset_attention_mask: bool,
                     cp_rank: int = 0, cp: int = 1, device: torch.device | str | None = None) -> Documents | None:
    """The ``Documents`` of the whole samples ``tokens [B, S]`` (the model's inputs, on the CPU) for CP rank
    ``cp_rank`` of ``cp``, or None when neither reset is asked for. The positions are split as the tokens are and
    moved to ``device``."""
    if not (reset_position_ids or reset_attention_mask):
        return None
    tokens_BS = tokens_BS.cpu()
    S = tokens_BS.shape[1]
    starts = document_starts(tokens_BS, eod)
    positions = None
    if reset_position_ids:
        positions = split_for_context_parallel(restarted_positions(starts, S), cp_rank, cp, seq_dim=1)
        positions = positions.to(device) if device is not None else positions
    return Documents(starts, S, isolate=reset_attention_mask, positions=positions)
