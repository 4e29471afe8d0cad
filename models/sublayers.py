"""A decoder block as sub-layer pieces for the batch-level overlap schedules (Megatron's fine-grained callables).

A block with an MoE FFN becomes five pieces, the token exchanges between local computations::

    pre       (compute)   x -> h = x + attention(norm(x)); norm(h) -> shared experts, router, the dispatcher's
                          preparation (split sizes, permutation)
    dispatch  (exchange)  the rows to the experts' ranks
    mlp       (compute)   the dispatcher's finish (etp gather, sort), the routed experts, the combine's preparation
    combine   (exchange)  the outputs back home
    post      (compute)   each token's copies summed with their probs, + shared experts, + h

A dense block (or one whose FFN has no exchange) is one compute piece. ``pipeline.overlap`` runs the pieces with
a cut between every two (each piece's graph starts at leaves), so it can run one micro-batch's exchange while
another micro-batch's compute runs, forward and backward. The pieces compute exactly what
``TransformerBlock.forward`` computes, with the same modules: the plain path and the pieces differ only in where
the graph is cut.

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

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from moefold.dense.block import TransformerBlock
from moefold.dense.recompute import CheckpointWithoutOutput
from moefold.dispatch.token_exchange import TokenExchange
from moefold.moe.layer import MoEDispatchStart, MoELayer, MoEOutputInfo


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
    norm: CheckpointWithoutOutput | None


@dataclass(frozen=True)
class _Arrived:
    pre: _Pre
    received: tuple[Tensor, ...]
    meta: Any


@dataclass(frozen=True)
class _Experts:
    pre: _Pre
    back: tuple[Tensor, ...]
    handle: Any


@dataclass(frozen=True)
class _Returned:
    experts: _Experts
    received: tuple[Tensor, ...]


def block_pieces(block: TransformerBlock, index: int, position_ids: Tensor, ffn_kwargs: dict[str, Any],
                 recompute: bool = False) -> list[Piece]:
    """The pieces of block ``index`` (module docstring); ``ffn_kwargs`` go to the FFN (the MoE layer's
    ``global_state``), ``recompute``: full recompute of this block, piece by piece."""
    moe = block.mlp if isinstance(block.mlp, MoELayer) and block.mlp.dispatcher.staged else None
    if moe is None:
        def whole(carry: LayerCarry) -> LayerCarry:
            hidden, info = block(carry.hidden, position_ids, **ffn_kwargs)
            return LayerCarry(hidden, carry.infos if info is None else {**carry.infos, index: info})

        return [Compute(f"layer{index}", whole, recompute)]

    def pre(carry: LayerCarry) -> _Pre:
        x = carry.hidden
        h = x + block._after_norm(block.input_layernorm, x, lambda n: block.self_attn(n, position_ids))
        norm = CheckpointWithoutOutput() if block.recompute_layernorm else None
        normed = norm.checkpoint(block.post_attention_layernorm, h) if norm is not None else \
            block.post_attention_layernorm(h)
        return _Pre(carry, h, moe.route_and_prepare(normed, **ffn_kwargs), norm)

    def dispatch_split(p: _Pre) -> tuple[TokenExchange, tuple[Tensor, ...], _Pre]:
        return moe.dispatcher.dispatch_exchange(p.start.prep), p.start.sent, p

    def experts(a: _Arrived) -> _Experts:
        back, handle = moe.experts_step(a.received, a.meta, a.pre.start.prep)
        if a.pre.norm is not None:   # refilled when this output's gradient arrives, before the pre piece's backward
            a.pre.norm.discard_output_and_register_recompute(back[0])
        return _Experts(a.pre, back, handle)

    def combine_split(e: _Experts) -> tuple[TokenExchange, tuple[Tensor, ...], _Experts]:
        return moe.dispatcher.combine_exchange(e.handle), e.back, e

    def post(r: _Returned) -> LayerCarry:
        p = r.experts.pre
        y = moe.combine_finish(r.received, r.experts.handle, p.residual, p.start.split_tokens, p.start.shared_SBH)
        return LayerCarry(p.residual + y, {**p.carry.infos, index: p.start.info})

    return [Compute(f"layer{index}.pre", pre, recompute),
            Exchange(f"layer{index}.dispatch", dispatch_split, lambda p, received, meta: _Arrived(p, received, meta)),
            Compute(f"layer{index}.mlp", experts, recompute),
            Exchange(f"layer{index}.combine", combine_split, lambda e, received, _meta: _Returned(e, received)),
            Compute(f"layer{index}.post", post, recompute)]


def check_overlap(block: TransformerBlock, index: int) -> None:
    """ValueError naming the flag when block ``index`` cannot run as pieces with the overlap schedules."""
    if isinstance(block.mlp, MoELayer):
        if not block.mlp.dispatcher.staged:
            d = block.mlp.dispatcher
            what = f"{d.name!r} on DeepEP V2" if getattr(d, "backend", None) == "deepep" else repr(d.name)
            raise ValueError(f"--overlap-moe-expert-parallel-comm runs with the alltoall dispatcher and flex on "
                             f"DeepEP's v1 API, not {what} (its exchange is not a separate step): use "
                             f"--moe-token-dispatcher-type alltoall or --moe-flex-dispatcher-backend deepep-legacy")
        if block.recompute_ffn:
            raise ValueError("--overlap-moe-expert-parallel-comm cannot checkpoint the whole MoE layer "
                             "(--recompute-modules moe): the checkpoint would span its exchanges; recompute "
                             "moe_act and shared_experts instead, or use full recompute")


__all__ = ["Compute", "Exchange", "LayerCarry", "Piece", "block_pieces", "check_overlap"]
