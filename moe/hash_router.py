"""Hash routing (DeepSeek-V4's ``hash_moe`` layers): a frozen token-id -> expert-id table picks the experts.

    router = HashRouter(config, hidden_size, vocab_size, RouterGroups.from_dims(dims))
    out = router(x_TH, token_ids_T=ids)       # ids: int64 [T], the vocabulary id of each of this rank's tokens

The table ``tid2eid`` [V, K] (int64, a persistent buffer: model state, never trained) holds each vocabulary
token's K global expert ids. Only the selection is static: the gate weight still scores the experts, and the
combine weights are those scores at the table's ids, renormalised and scaled exactly as the top-k router's
(``moe.scoring.combine_weights``; HF ``DeepseekV4HashRouter``). Everything after the selection (capacity, the
balance losses, statistics) is the top-k router's, fed the table's ids as routing replay feeds recorded ones, so
every dispatcher and layout takes it unchanged: the ids are global expert ids. Nothing here crosses ranks beyond
what ``Router`` does.

A fresh table (training from scratch) maps token v to K distinct experts ``(pi(v) * K + j) mod E`` with ``pi`` a
seeded permutation of the vocabulary: each expert receives the same number of vocabulary entries (within one),
on every rank alike. A checkpoint (``--load-hf``) overwrites it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moefold.moe.balance_losses import GlobalLoadState
from moefold.moe.router import Router, RouterGroups, RouterOutput
from moefold.moe.router_config import RouterConfig
from moefold.moe.scoring import forced_uniform_ids

# what would pick experts other than the table; each is refused rather than silently ignored
_SELECTION_OPTIONS = ("enable_expert_bias", "quantile_balancing", "force_load_balancing", "num_groups")


def balanced_table(vocab_size: int, topk: int, num_experts: int, seed: int = 0) -> Tensor:
    """int64 [V, K]: token v -> experts ``(pi(v) * K + j) mod E`` (distinct per token; loads equal within one)."""
    perm = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
    return forced_uniform_ids(vocab_size, topk, num_experts, torch.device("cpu"))[perm]


class HashRouter(Router):
    """``Router`` whose selection is ``tid2eid[token_ids]`` (module docstring). ``vocab_size``: rows of the table."""

    def __init__(self, config: RouterConfig, hidden_size: int, vocab_size: int,
                 groups: RouterGroups | None = None, *, device: torch.device | str | None = None) -> None:
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"HashRouter: vocab_size={vocab_size!r} must be a positive integer")
        chosen = [name for name in _SELECTION_OPTIONS if getattr(config, name)]
        if chosen:
            raise ValueError(f"HashRouter: {', '.join(chosen)} would change which experts are chosen, but a "
                             f"hash-routed layer's table fixes them; set them off for hash_moe layers")
        super().__init__(config, hidden_size, groups or RouterGroups(), device=device)
        self.vocab_size = vocab_size
        table = balanced_table(vocab_size, config.topk, config.num_experts)
        self.register_buffer("tid2eid", table.to(device) if device is not None else table)

    def expert_ids(self, token_ids: Tensor) -> Tensor:
        """int64 [..., K]: the table's experts of each token id (any shape of int ids in [0, V))."""
        if token_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"HashRouter: token ids must be int32/int64, got {token_ids.dtype}")
        return self.tid2eid[token_ids.to(torch.int64)].to(torch.int64)

    def forward(self, x_TH: Tensor, *, token_ids_T: Tensor | None = None, seq_ids_T: Tensor | None = None,
                num_seqs: int | None = None, global_state: GlobalLoadState | None = None,
                generator: torch.Generator | None = None, reduce_stats: bool = False,
                replayed_ids_TK: Tensor | None = None) -> RouterOutput:
        """As ``Router.forward`` with the selection from the table: ``token_ids_T`` int64 [T] (this rank's tokens'
        vocabulary ids), or ``replayed_ids_TK`` (the table's ids already looked up, as ``MoELayer`` passes them)."""
        if (token_ids_T is None) == (replayed_ids_TK is None):
            raise ValueError("HashRouter: pass exactly one of token_ids_T (the tokens' vocabulary ids) and "
                             "replayed_ids_TK (their table rows)")
        if token_ids_T is not None:
            if token_ids_T.shape != (x_TH.shape[0],):
                raise ValueError(f"HashRouter: token_ids_T has shape {tuple(token_ids_T.shape)}, expected "
                                 f"[{x_TH.shape[0]}] (one id per token of x_TH)")
            replayed_ids_TK = self.expert_ids(token_ids_T)
        return super().forward(x_TH, seq_ids_T=seq_ids_T, num_seqs=num_seqs, global_state=global_state,
                               generator=generator, reduce_stats=reduce_stats, replayed_ids_TK=replayed_ids_TK)

    def extra_repr(self) -> str:
        return f"experts={self.config.num_experts}, topk={self.config.topk}, vocab={self.vocab_size}"


__all__ = ["HashRouter", "balanced_table"]
