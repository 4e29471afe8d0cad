"""Fine-grained activation offloading in a built decoder: which regions offload (``apply_activation_offload``).

The mechanism is ``execution.offloader``; the choice is Megatron's ``--offload-modules`` (``offload_modules``, names
and checks in ``dense.activation_offload``). Every chosen part of every block (the decoder's layers and the MTP
blocks) gets a region of one ``ActivationOffloader`` per model (per process: its side streams are shared by every
layer), tagged with the block's global layer index for the one-layer-ahead prefetch in backward, installed through
the layer's ``configure`` (``REGIONS``: which region of which layer each name is). The decoder's ``layers`` run becomes
``OffloadedChunks``, which starts a chunk before its layers and hooks its output for the prefetch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from moefold.dense.attention import GQAAttention
from moefold.dense.block import TransformerBlock
from moefold.dense.mla import MLAttention
from moefold.dense.regions import PLAIN, Region
from moefold.execution.offloader import ActivationOffloader, OffloadRegion
from moefold.models.decoder import LayerRun, MoEDecoder
from moefold.moe.experts import GroupedExperts
from moefold.moe.layer import MoELayer

# layer class -> the offload module names that are its regions of the same name (``dense.regions``)
REGIONS: dict[type, tuple[str, ...]] = {
    TransformerBlock: ("attn_norm", "mlp_norm"),
    GQAAttention: ("qkv_linear", "core_attn", "attn_proj"),
    MLAttention: ("qkv_linear", "core_attn", "attn_proj"),
    GroupedExperts: ("expert_fc1", "moe_act"),
    MoELayer: ("shared_experts",),
}


class OffloadedChunks:
    """The decoder's ``layers`` run with offloading: ``inner``'s groups; each chunk's offloaded tensors go together
    (``begin_chunk``) and the chunk's output brings back its last two layers' groups (``end_chunk``)."""

    def __init__(self, offloader: ActivationOffloader, inner: LayerRun) -> None:
        self.offloader, self.inner = offloader, inner

    def groups(self, layer_ids: list[int]) -> list[tuple[list[int], bool]]:
        return self.inner.groups(layer_ids)

    def begin_chunk(self) -> None:
        self.inner.begin_chunk()
        self.offloader.begin_chunk()

    def end_chunk(self, hidden: Tensor) -> Tensor:
        return self.offloader.end_chunk(self.inner.end_chunk(hidden))

    def __repr__(self) -> str:
        return f"OffloadedChunks({self.inner!r})"


def apply_activation_offload(model: MoEDecoder, modules: Sequence[str], min_tensor_numel: int,
                             device: torch.device | str) -> ActivationOffloader | None:
    """Give every chosen part (``modules``) of ``model``'s blocks a region of one new offloader (returned; None when
    nothing is offloaded) and bracket the model's chunks with it. ``device``: where the model computes."""
    if not modules:
        return None
    offloader = ActivationOffloader(device, min_tensor_numel)
    chosen = set(modules)
    blocks = {int(i): b for i, b in model.layers.items()} | {m.index: m.block for m in model.mtp}
    for layer, block in blocks.items():
        for module in block.modules():
            names = [n for n in REGIONS.get(type(module), ()) if n in chosen]
            if names:   # around the region in force (a checkpoint stays inside: ``OffloadRegion.inner``)
                module.configure(**{n: offloader.region(n, layer, module, _inner(getattr(module.regions, n)))
                                    for n in names})
    model.configure(layers=OffloadedChunks(offloader, model.regions.layers))
    return offloader


def _inner(region: object) -> Region:
    """What an offload region runs its part through: the wrap region it replaces (a checkpoint: ``check_offload``
    refuses choosing both, but they compose), else ``PLAIN`` (an output region, the norms', is replaced)."""
    return region if isinstance(region, Region) else PLAIN


def offloaded_parts(model: nn.Module) -> dict[str, int]:
    """{offload module name: how many regions the model runs it in} (tests, the start-up line)."""
    out: dict[str, int] = {}
    for module in model.modules():
        for name in REGIONS.get(type(module), ()):
            if isinstance(getattr(module.regions, name), OffloadRegion):
                out[name] = out.get(name, 0) + 1
    return out


__all__ = ["REGIONS", "OffloadedChunks", "apply_activation_offload", "offloaded_parts"]
