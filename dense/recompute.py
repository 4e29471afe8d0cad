"""Activation recomputation modes and the checkpoint call every module uses.

``none``: keep all activations. ``selective``: recompute only core attention (the S x S part;
the attention modules do it, see ``dense.core_attention``). ``full``: recompute the whole
transformer block in backward (``TransformerBlock`` does it). Both go through
``torch.utils.checkpoint`` non-reentrant, which restores the RNG state and supports outputs
that are nested structures (the MoE layer's extra losses). Nothing crosses ranks here; a
checkpointed region replays its collectives in backward, identically on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

RECOMPUTE_MODES = ("none", "selective", "full")


def check_recompute(mode: str, where: str = "recompute") -> str:
    """Return ``mode`` if it is one of ``RECOMPUTE_MODES``, else raise a ValueError naming it."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"{where}={mode!r} is not one of {RECOMPUTE_MODES}")
    return mode


def checkpointed(fn: Callable[..., Any], *args: Any, enabled: bool = True, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, its activations recomputed in backward when ``enabled`` and grad is on."""
    if not enabled or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)
