"""A decoder block as sub-layer pieces for the batch-level overlap schedules (Megatron's fine-grained callables).

A block with an MoE FFN becomes five pieces, the token exchanges between local computations::

    pre       (compute)   x -> h = x + attention(norm(x)); norm(h) -> router, the dispatcher's preparation (split
                          sizes, permutation), shared experts
    dispatch  (exchange)  the rows to the experts' ranks
    mlp       (compute)   the dispatcher's finish (etp gather, sort), the routed experts, the combine's preparation
    combine   (exchange)  the outputs back home
    post      (compute)   each token's copies summed with their probs, + shared experts, + h

A dense block (or one whose FFN has no exchange) is one compute piece. ``pipeline.overlap`` runs the pieces with
a cut between every two (each piece's graph starts at leaves), so it can run one micro-batch's exchange while
another micro-batch's compute runs, forward and backward. The pieces compute exactly what
``TransformerBlock.forward`` computes, with the same public pieces (the block's ``attention_residual`` and
``ffn_input``, the MoE layer's ``route_and_prepare`` / ``shared_step`` / ``experts_step`` / ``combine_finish``, the
dispatcher's exchanges): the plain path and the pieces differ only in where the graph is cut.

A piece's input and output is a *carry*: ``LayerCarry`` (the hidden state and the MoE infos collected so far)
between blocks, and the small frozen records below inside one. Tensors on the graph inside a carry (the residual,
the routing probs inside the dispatcher's prep, the aux loss) are what crosses a cut.

Recompute: selective recompute runs inside the pieces as in the plain block (``core_attn``, ``mla_up_proj``,
``shared_experts``, ``moe_act``; ``layernorm``: the post-attention norm's output is discarded once the pre piece
used it and refilled when the mlp piece's output gradient arrives, before the pre piece's backward, as Megatron
does). ``full`` recompute checkpoints every compute piece of the chosen layers (the exchanged rows are kept, not
exchanged again). A checkpoint around the whole MoE layer (``--recompute-modules moe``) would span the exchanges:
refused by ``check_overlap``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from moefold.dense.block import TransformerBlock
from moefold.dense.documents import Documents
from moefold.dense.regions import OpenedOutput, recomputes
from moefold.dispatch.config import DispatcherKind
from moefold.dispatch.token_exchange import TokenExchange
from moefold.moe.layer import MoEDispatchStart, MoEExpertsOut, MoELayer, MoEOutputInfo


@dataclass(frozen=True)
class Compute:
    """A local piece: ``fn(carry) -> carry``, on the autograd graph of its input's leaves. ``recompute``: checkpoint
    it (its activations recomputed in its backward). ``borrowed``: (tensor, leaf) pairs this piece's backward also
    runs, the leaf's gradient into the tensor (a weight another piece used through a leaf, so that its gradient is
    accumulated once per micro-batch, as in the plain backward)."""

    name: str
    fn: Callable[[Any], Any]
    recompute: bool = False
    borrowed: tuple[tuple[Tensor, Tensor], ...] = ()


@dataclass(frozen=True)
class Exchange:
    """A token exchange between two computes: ``split(carry) -> (exchange, tensors to send, rest)`` and
    ``join(rest, received, meta) -> carry`` (``received``: leaves of the arrived tensors)."""

    name: str
    split: Callable[[Any], tuple[TokenExchange, tuple[Tensor, ...], Any]]
    join: Callable[[Any, tuple[Tensor, ...], Any], Any]


Piece = Compute | Exchange


@dataclass(frozen=True)
class LayerCarry:
    """Between blocks: the hidden state ``[S, B, H]`` and the MoE infos of the blocks run so far (by layer)."""

    hidden: Tensor
    infos: dict[int, MoEOutputInfo] = field(default_factory=dict)


@dataclass(frozen=True)
class _Pre:
    carry: LayerCarry
    residual: Tensor
    start: MoEDispatchStart
    shared_SBH: Tensor | None
    norm: OpenedOutput   # the post-attention norm's output region, opened for this call


@dataclass(frozen=True)
class _Arrived:
    pre: _Pre
    received: tuple[Tensor, ...]
    meta: object


@dataclass(frozen=True)
class _Experts:
    pre: _Pre
    out: MoEExpertsOut


@dataclass(frozen=True)
class _Returned:
    experts: _Experts
    received: tuple[Tensor, ...]


def block_pieces(block: TransformerBlock, index: int, position_ids: Tensor, ffn_kwargs: dict[str, Any],
                 recompute: bool = False, documents: Documents | None = None) -> list[Piece]:
    """The pieces of block ``index`` (module docstring); ``ffn_kwargs`` go to the FFN (the MoE layer's
    ``global_state``), ``recompute``: full recompute of this block, piece by piece; ``documents``: the
    micro-batch's packed documents (``dense.documents``), or None."""
    # an mHC block (block.hyper) runs whole: its FFN residual is a stream mix, not the pieces' add
    moe = block.mlp if isinstance(block.mlp, MoELayer) and block.hyper is None else None
    if moe is None:
        def whole(carry: LayerCarry) -> LayerCarry:
            hidden, info = block(carry.hidden, position_ids, documents, **ffn_kwargs)
            return LayerCarry(hidden, carry.infos if info is None else {**carry.infos, index: info})

        return [Compute(f"layer{index}", whole, recompute)]

    def pre(carry: LayerCarry) -> _Pre:
        h = block.attention_residual(carry.hidden, position_ids, documents)
        normed, norm = block.ffn_input(h)   # as the block's own forward runs it (the overlap refuses offloading)
        start = moe.route_and_prepare(normed, **ffn_kwargs)
        return _Pre(carry, h, start, moe.shared_step(normed), norm)

    def dispatch_split(p: _Pre) -> tuple[TokenExchange, tuple[Tensor, ...], _Pre]:
        return moe.dispatcher.dispatch_exchange(p.start.prep), p.start.sent, p

    def experts(a: _Arrived) -> _Experts:
        out = moe.experts_step(a.received, a.meta, a.pre.start.prep)
        # a discarded norm output is refilled when this output's gradient arrives, before the pre piece's backward
        a.pre.norm.consumed(out.sent[0])
        return _Experts(a.pre, out)

    def combine_split(e: _Experts) -> tuple[TokenExchange, tuple[Tensor, ...], _Experts]:
        return moe.dispatcher.combine_exchange(e.out.handle), e.out.sent, e

    def post(r: _Returned) -> LayerCarry:
        p, out = r.experts.pre, r.experts.out
        y = moe.combine_finish(r.received, out.handle, p.residual, p.start.split_tokens, p.shared_SBH)
        info = dataclasses.replace(p.start.info, received_E=out.received_E)
        return LayerCarry(p.residual + y, {**p.carry.infos, index: info})

    return [Compute(f"layer{index}.pre", pre, recompute),
            Exchange(f"layer{index}.dispatch", dispatch_split, lambda p, received, meta: _Arrived(p, received, meta)),
            Compute(f"layer{index}.mlp", experts, recompute),
            Exchange(f"layer{index}.combine", combine_split, lambda e, received, _meta: _Returned(e, received)),
            Compute(f"layer{index}.post", post, recompute)]


def check_overlap(block: TransformerBlock, index: int) -> None:
    """ValueError naming the flag when block ``index`` cannot run as pieces with the overlap schedules."""
    if block.hyper is not None:
        raise ValueError(f"--overlap-moe-expert-parallel-comm: block {index} has mHC streams (DeepSeek-V4's "
                         "hyper-connections), which the overlap's pieces do not run yet; leave the flag off")
    if isinstance(block.mlp, MoELayer):
        kind = block.mlp.dispatcher.kind
        if kind is DispatcherKind.ALLGATHER:
            raise ValueError(f"--overlap-moe-expert-parallel-comm runs with the alltoall and flex dispatchers, not "
                             f"'{kind}' (its gather runs at once after a host sync: nothing in flight to hide; "
                             f"Megatron refuses it too): use --moe-token-dispatcher-type alltoall")
        if recomputes(block.regions.ffn):
            raise ValueError("--overlap-moe-expert-parallel-comm cannot checkpoint the whole MoE layer "
                             "(--recompute-modules moe): the checkpoint would span its exchanges; recompute "
                             "moe_act and shared_experts instead, or use full recompute")


__all__ = ["Compute", "Exchange", "LayerCarry", "Piece", "block_pieces", "check_overlap"]
