"""The per-MoE-layer counts a training step sums: every micro-batch adds this rank's to one float64 device tensor
``[moe layers, E + 1 + ROUTER_SUMS + E]`` (per layer: selections per expert, dropped copies, the router sums below,
the copies each expert received as its dispatcher counted them), which ``Trainer.train_step`` all-reduces over
the world once per step (other pipeline stages add zeros to the rows they do not own) and copies to the host
once. Float64 sums of counts stay exact.

Router sums, per layer: the router losses' shares (they add up over tp x cp to the micro-batch value), the summed
router entropy of the tokens and their number; ``per_step_router`` turns a step's into means over its
micro-batches, ``router_layer_metrics`` a log window's into the logged per-layer metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

ROUTER_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "z_loss")
ROUTER_SUMS = len(ROUTER_LOSSES) + 2


def router_sums(info: Any, topk: int) -> Any:
    """This rank's ``[ROUTER_SUMS]`` contribution of one MoE layer call (an ``MoEOutputInfo``): its loss
    shares (they add up over tp x cp to the micro-batch value), its tokens' summed entropy and its tokens."""
    import torch

    load = info.load_E.detach().float()
    tokens = load.sum() / topk   # every token selects exactly topk experts (before capacity)
    zero = torch.zeros((), device=load.device)
    entropy = info.stats.entropy.detach().float() * tokens if info.stats is not None else zero
    losses = [info.losses[n].detach().float().reshape(()) if n in info.losses else zero for n in ROUTER_LOSSES]
    return torch.stack([*losses, entropy, tokens])


def per_step_router(sums: Any, micro_batches: int) -> Any:
    """Summed ``[layers, ROUTER_SUMS]`` of one step over all ranks -> losses as means over the step's
    ``micro_batches`` (num_micro x dp); entropy and token sums unchanged."""
    out = sums.clone()
    out[:, :len(ROUTER_LOSSES)] /= micro_batches
    return out


def router_layer_metrics(acc: Any, steps: int, model_config: Any) -> dict[str, list[float | None]]:
    """Per-layer means over ``steps`` accumulated ``per_step_router`` rows: every router loss ``model_config``
    enables and the mean token entropy."""
    from moefold.models.layer_factory import router_config
    from moefold.models.options import ModelOptions

    router = router_config(model_config, ModelOptions())
    enabled = set(router.loss_coeffs()) | ({"z_loss"} if router.z_loss_coeff else set())
    out: dict[str, list[float | None]] = {}
    for k, name in enumerate(ROUTER_LOSSES):
        if name in enabled:
            out[name] = [float(v) / max(steps, 1) for v in acc[:, k].tolist()]
    entropy, tokens = acc[:, len(ROUTER_LOSSES)].tolist(), acc[:, len(ROUTER_LOSSES) + 1].tolist()
    out["entropy"] = [e / n if n > 0 else None for e, n in zip(entropy, tokens)]
    return out


def add_expert_counts(counts: Any, infos: Iterable[tuple[int, Any]], moe_layers: Sequence[int], E: int,
                      topk: int) -> None:
    """Adds (global layer index, ``MoEOutputInfo``) pairs' selections, dropped copies, router sums and received
    copies (where the dispatcher counts them) to their rows (the layer's place in ``moe_layers``) of ``counts``
    ``[moe layers, E + 1 + ROUTER_SUMS (+ E)]``, on the device."""
    for i, info in infos:
        j = moe_layers.index(i)
        load = info.load_E.detach().to(counts)
        counts[j, :E] += load
        if info.stats is not None:
            counts[j, E] += info.stats.dropped_fraction.to(counts) * load.sum()
        counts[j, E + 1:E + 1 + ROUTER_SUMS] += router_sums(info, topk).to(counts)
        if info.received_E is not None:
            counts[j, E + 1 + ROUTER_SUMS:] += info.received_E.to(counts)


def add_micro_loads(loads: Any, infos: Iterable[tuple[int, Any]], moe_layers: Sequence[int]) -> None:
    """Adds one micro-batch's routed copies per layer and expert to ``loads`` ``[moe layers, E]`` (the imbalance
    watch's, ``training.observe.imbalance``)."""
    for i, info in infos:
        loads[moe_layers.index(i)] += info.load_E.detach().to(loads)
