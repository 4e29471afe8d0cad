"""Text generation with a KV cache: greedy, or temperature / top-k / top-p sampling.

    model = import_hf("Qwen3-30B-A3B", options=ModelOptions(sequence_parallel=False))
    out_BT = generate(model, prompt_ids_BS, max_new_tokens=64)                    # greedy
    out_BT = generate(model, prompt_ids_BS, 64, temperature=0.8, top_p=0.95, seed=0)

The cache works through the model's own attention modules: for the duration of ``generate`` every
layer's core attention (``dense.core_attention.CoreAttention``, which receives q/k/v after the
projections, qk-norm and RoPE, for GQA and MLA alike) is swapped for ``CachedCoreAttention``, which
appends the new keys/values to the layer's cache and attends the new queries to all of them (causal and
sliding-window masks from the true positions). A Gated DeltaNet layer (``dense.gated_deltanet``) keeps a
``RecurrentCache`` instead: its convolution's last inputs and its delta-rule state, so each step costs the
same however long the sequence is. A DeepSeek sparse attention layer (``dense.dsa``) keeps a ``LatentCache``: its
latent and indexer keys, which its indexer scores and its queries gather from. The prompt runs through the model
once (prefill), then one token per step; the output head runs on the last position only.

Layouts: world 1, and any layout with pp = 1 and cp = 1: expert parallelism (tokens reach their
experts through the usual dispatcher), tensor parallelism when the batch is divisible by tp (build the
model with ``sequence_parallel=False``: a single new token cannot be split along the sequence), data
parallelism (replicas). Every rank gets the same logits (gathered over tp) and draws from the same
seeded generator, so every rank produces the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from moefold.dense.context_parallel import position_mask, sdpa
from moefold.dense.core_attention import CoreAttention
from moefold.dense.dsa import DSAttention, LatentCache
from moefold.dense.gated_deltanet import GatedDeltaNet, RecurrentCache
from moefold.models.decoder import MoEDecoder
from moefold.parallel.comm import gather_along_dim


class CachedCoreAttention(nn.Module):
    """A layer's core attention with a growing K/V cache (inference only).

    forward(q ``[S, B, h, d]``, k ``[S, B, g, d]``, v ``[S, B, g, dv]``, position_ids ``[S]``, sinks ``[h]`` or
    None) appends k/v (and their positions) to the cache and returns ``[S, B, h*dv]`` of q against every cached
    key (with the layer's attention sinks in the softmax)."""

    def __init__(self, core: CoreAttention) -> None:
        super().__init__()
        self.scale, self.sliding_window = core.scale, core.sliding_window
        self.k = self.v = self.positions = None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, sinks: Tensor | None = None,
                documents: object = None) -> Tensor:
        if documents is not None:
            raise ValueError("generation with a KV cache continues one sequence per sample: it takes no packed "
                             "documents")
        S, B = q.shape[:2]
        self.k = k if self.k is None else torch.cat([self.k, k])
        self.v = v if self.v is None else torch.cat([self.v, v])
        self.positions = position_ids if self.positions is None else torch.cat([self.positions, position_ids])
        mask = position_mask(position_ids, self.positions, self.sliding_window)
        q_, k_, v_ = (t.permute(1, 2, 0, 3) for t in (q, self.k, self.v))   # [B, heads, S, d]
        out = sdpa(q_, k_, v_, scale=self.scale, attn_mask=mask, sinks=sinks)
        return out.permute(2, 0, 1, 3).reshape(S, B, -1)


@contextmanager
def kv_cache(model: MoEDecoder) -> Iterator[list[CachedCoreAttention | RecurrentCache | LatentCache]]:
    """Swap every main layer's core attention for a fresh ``CachedCoreAttention``, give every Gated DeltaNet
    layer a fresh ``RecurrentCache`` and every DeepSeek sparse attention layer a ``LatentCache`` (undone on exit)."""
    swapped, recurrent = [], []
    for block in model.layers.values():
        mixer = block.self_attn
        if isinstance(mixer, GatedDeltaNet):
            mixer.cache = RecurrentCache()
            recurrent.append(mixer)
        elif isinstance(mixer, DSAttention):   # its latent and indexer keys (it has no separate core attention)
            mixer.cache = LatentCache()
            recurrent.append(mixer)
        else:
            swapped.append((mixer, mixer.core))
            mixer.core = CachedCoreAttention(mixer.core)
    try:
        yield [attention.core for attention, _ in swapped] + [mixer.cache for mixer in recurrent]
    finally:
        for attention, core in swapped:
            attention.core = core
        for mixer in recurrent:
            mixer.cache = None


def check_generation_layout(model: MoEDecoder, batch: int) -> None:
    dims = model.dims
    if dims.pp > 1 or dims.cp > 1:
        raise ValueError(f"generation runs the whole model over its sequence on each rank: pp={dims.pp} and "
                         f"cp={dims.cp} must be 1")
    if dims.tp > 1 and (model.sequence_parallel or batch % dims.tp):
        raise ValueError(f"generation at tp={dims.tp} needs sequence_parallel=False and a batch divisible by tp "
                         f"(got sequence_parallel={model.sequence_parallel}, batch {batch})")


def next_token(logits_BV: Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               generator: torch.Generator | None = None) -> Tensor:
    """[B] token ids: argmax when ``temperature == 0``, else a sample of softmax(logits / temperature)
    restricted to the ``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p``."""
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits = logits_BV.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the ones before it already reach top_p (the most likely one always stays)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    if generator is not None:   # draw where the generator lives (the same tokens on every device)
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits_BV.device)


@torch.no_grad()
def generate(model: MoEDecoder, input_ids: Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, eos_token_id: int | Sequence[int] | None = None,
             seed: int | None = None) -> Tensor:
    """``input_ids [B, S]`` followed by up to ``max_new_tokens`` generated tokens, ``[B, S + n]``.

    Stops when every sequence has produced an ``eos_token_id`` (later positions of a finished sequence
    repeat that eos). Collective over the model's groups when it is parallel (see the module docstring).
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [batch, prompt length >= 1], got {tuple(input_ids.shape)}")
    if max_new_tokens < 0 or temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}, temperature={temperature}, top_k={top_k}, "
                         f"top_p={top_p}: need >= 0, >= 0, >= 0 and (0, 1]")
    B, S = input_ids.shape
    limit = model.config.max_position_embeddings
    if S + max_new_tokens > limit:
        raise ValueError(f"prompt ({S}) + max_new_tokens ({max_new_tokens}) exceeds max_position_embeddings={limit}")
    check_generation_layout(model, B)
    device = next(model.parameters()).device
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or []), device=device)
    generator = None
    if seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(seed)
    was_training = model.training
    model.eval()
    out, done = input_ids.to(device), torch.zeros(B, dtype=torch.bool, device=device)
    try:
        with kv_cache(model), model.fp8_region():
            ids, positions = out, torch.arange(S, device=device)
            for _ in range(max_new_tokens):
                hidden, _ = model.run_layers(model.embed(ids), positions)
                logits = gather_along_dim(model.head_logits(hidden[-1:]).float(), model.dims.tp_group, dim=-1)[0]
                token = next_token(logits, temperature, top_k, top_p, generator)
                if eos.numel():
                    token = torch.where(done, out[:, -1], token)   # a finished sequence repeats its eos
                    done = done | torch.isin(token, eos)
                out = torch.cat([out, token[:, None]], dim=1)
                if eos.numel() and bool(done.all()):
                    break
                ids, positions = token[:, None], positions[-1:] + 1
    finally:
        model.train(was_training)
    return out
