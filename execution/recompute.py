"""Activation recomputation in a built model: which regions checkpoint (``apply_recompute``) and how full recompute
groups the layers of one pipeline chunk (``full_recompute_groups``, installed as the decoder's ``layers`` run).

The options are Megatron's (``recompute``, ``recompute_modules``, ``recompute_method``, ``recompute_num_layers``;
the names and their semantics in ``dense.recompute``). Selective choices become regions of the layers that own
them, installed through each layer's ``configure``:

============== ======================================= ===========================================
module          region                                  installed
============== ======================================= ===========================================
core_attn       attention / DeltaNet ``core_attn``       ``CHECKPOINT``
mla_up_proj     ``MLAttention.up_proj``                  ``DISCARD_OUTPUT``
layernorm       ``TransformerBlock.attn_norm/mlp_norm``  ``DISCARD_OUTPUT``
mlp / moe       ``TransformerBlock.ffn``                 ``CHECKPOINT``
shared_experts  ``MoELayer.shared_experts``               ``CHECKPOINT``
moe_act         ``GroupedExperts.moe_act``               ``DISCARD_OUTPUT``
============== ======================================= ===========================================

A region not chosen is set back to ``PLAIN`` / ``KEEP_OUTPUT`` (a layer built with ``recompute="selective"``
checkpoints its core attention until the pass says otherwise). Full recompute of the decoder's layers is the
decoder's ``layers`` run (``FullRecompute``), so the layers stop checkpointing themselves (``body`` = ``PLAIN``);
MTP blocks, which run one at a time, keep checkpointing themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import Tensor, nn

from moefold.dense.attention import GQAAttention
from moefold.dense.block import TransformerBlock
from moefold.dense.choices import Recompute, RecomputeMethod
from moefold.dense.gated_deltanet import GatedDeltaNet
from moefold.dense.mla import MLAttention
from moefold.dense.recompute import CheckpointWithoutOutput, recomputed_modules
from moefold.dense.regions import CHECKPOINT, KEEP_OUTPUT, PLAIN
from moefold.models.decoder import ALL_LAYERS, LayerRun
from moefold.moe.expert_gemm import Fp8Gemm, Projection
from moefold.moe.experts import GroupedExperts
from moefold.moe.layer import MoELayer


class RecomputeChoice(Protocol):
    """What the recompute functions read (``ModelOptions`` and ``execution.ExecutionPlan`` both have it)."""

    recompute: str
    recompute_modules: tuple[str, ...]
    recompute_method: str
    recompute_num_layers: int


class DiscardOutput:
    """The output-discarding checkpoint as an ``OutputRegion`` (``dense.recompute.CheckpointWithoutOutput``: the
    part's output is freed once its consumer saved it and recomputed just before the consumer's backward)."""

    recomputes = True

    def open(self) -> _OpenedDiscard:
        return _OpenedDiscard()

    def __repr__(self) -> str:
        return "DISCARD_OUTPUT"


class _OpenedDiscard:
    def __init__(self) -> None:
        self.ckpt = CheckpointWithoutOutput()

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.ckpt.checkpoint(fn, *args)

    def consumed(self, consumer_output: Tensor) -> None:
        self.ckpt.discard_output_and_register_recompute(consumer_output)


DISCARD_OUTPUT = DiscardOutput()


def apply_recompute(model: nn.Module, layers: nn.ModuleDict, choice: RecomputeChoice) -> None:
    """Install every selective-recompute region in ``model`` from ``choice``; ``layers`` (the decoder's blocks)
    stop checkpointing themselves: the decoder's ``layers`` run (``FullRecompute``) decides for them."""
    chosen = recomputed_modules(choice.recompute, choice.recompute_modules)

    def checkpoint_if(name: str) -> object:
        return CHECKPOINT if name in chosen else PLAIN

    def discard_if(name: str) -> object:
        return DISCARD_OUTPUT if name in chosen else KEEP_OUTPUT

    for module in model.modules():
        if isinstance(module, TransformerBlock):
            norm = discard_if("layernorm")
            ffn = "moe" if isinstance(module.mlp, MoELayer) else "mlp"
            module.configure(attn_norm=norm, mlp_norm=norm, ffn=checkpoint_if(ffn))
        elif isinstance(module, (GQAAttention, GatedDeltaNet)):   # DeltaNet: its delta rule
            module.configure(core_attn=checkpoint_if("core_attn"))
        elif isinstance(module, MLAttention):
            module.configure(core_attn=checkpoint_if("core_attn"), up_proj=discard_if("mla_up_proj"))
        elif isinstance(module, MoELayer):
            module.configure(shared_experts=checkpoint_if("shared_experts"))
        elif isinstance(module, GroupedExperts):
            module.configure(moe_act=discard_if("moe_act"))
            if "moe_act" in chosen and isinstance(module.gemm, Fp8Gemm):
                # the down GEMM keeps the activation itself (freed and refilled by the recompute), not an FP8 copy
                # that would stay: Megatron's set_save_original_input(linear_fc2) under moe_act recompute
                module.gemm.saving_original_input(Projection.FC2)
    for block in layers.values():
        block.configure(body=PLAIN)


def full_recompute_groups(layer_ids: list[int], choice: RecomputeChoice) -> list[tuple[list[int], bool]]:
    """``layer_ids`` (one pipeline chunk's, in order) cut into (consecutive ids, checkpointed as one unit).

    uniform N: every group of N layers is one checkpoint (its input is all that is kept). block N: the
    first N layers are checkpointed one by one, the rest run normally. Without full recompute: one
    unrecomputed group."""
    if choice.recompute != Recompute.FULL:
        return [(layer_ids, False)]
    n = choice.recompute_num_layers
    if choice.recompute_method == RecomputeMethod.UNIFORM:
        return [(layer_ids[i:i + n], True) for i in range(0, len(layer_ids), n)]
    groups = [([i], True) for i in layer_ids[:n]]
    return groups + ([(layer_ids[n:], False)] if layer_ids[n:] else [])


class FullRecompute:
    """The decoder's ``layers`` run under full recompute: the groups of ``full_recompute_groups``; a chunk's start
    and end are ``inner``'s."""

    def __init__(self, choice: RecomputeChoice, inner: LayerRun = ALL_LAYERS) -> None:
        self.choice, self.inner = choice, inner

    def groups(self, layer_ids: list[int]) -> list[tuple[list[int], bool]]:
        return full_recompute_groups(layer_ids, self.choice)

    def begin_chunk(self) -> None:
        self.inner.begin_chunk()

    def end_chunk(self, hidden: Tensor) -> Tensor:
        return self.inner.end_chunk(hidden)

    def __repr__(self) -> str:
        c = self.choice
        return f"FullRecompute({c.recompute_method} {c.recompute_num_layers})"


__all__ = ["DISCARD_OUTPUT", "DiscardOutput", "FullRecompute", "RecomputeChoice", "apply_recompute",
           "full_recompute_groups"]
