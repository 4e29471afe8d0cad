"""ZeRO-1 distributed AdamW: fp32 master weights and Adam moments partitioned over the reduction groups.

Each reduction kind's flat buffer (``training.grad_sync.FlatGroup``, padded to a multiple of its
group size ``n``) is cut into ``n`` equal contiguous shards; rank ``r`` of the group owns shard
``r``: the fp32 master copy of those elements, ``exp_avg`` and ``exp_avg_sq``. A step updates the
owned shard from the reduced gradient and all-gathers the new values into every replica's
parameters, so optimizer memory per rank is ``1/n`` of the unpartitioned one (``state_bytes()``).

The update is ``torch.optim.AdamW``'s (single-tensor form) element by element, so the result is
independent of the partitioning. Weight decay applies to parameters of two or more dimensions
whose name does not mark a norm/bias/expert bias (``decays()``).

Gradient norm: every element is counted once across the world. Within a group the shards are
disjoint; a parameter that is further replicated (e.g. a dense weight not split over tp, held by
every tp rank) is weighted by ``1 / replicas`` before the world-wide sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import group_rank
from moefold.parallel.sharding import shards_of
from moefold.training.grad_sync import FlatGroup, GradSync

NO_DECAY_MARKERS = ("norm", "bias", "expert_bias")


def decays(name: str, param: Tensor) -> bool:
    """Whether AdamW's weight decay applies: matrices only, never norms, biases or expert biases."""
    last = name.rsplit(".", 1)[-1].lower()
    lowered = name.lower()
    if param.dim() < 2 or last == "bias" or "expert_bias" in lowered:
        return False
    return not any(m in lowered for m in ("norm.", "layernorm", "_norm", "norm_"))


def replicas(param: Tensor, group_numel: int, dims: ParallelDims) -> int:
    """How many ranks of one pipeline stage hold the same element of ``param`` after the group
    reduction and ZeRO partition: stage ranks / (group size * shard count)."""
    per_stage = dims.world_size // dims.pp
    split = group_numel
    for s in shards_of(param):
        split *= s.num
    if per_stage % split:
        raise ValueError(f"parameter of shape {tuple(param.shape)}: group size x shards = {split} does not "
                         f"divide the {per_stage} ranks of a stage")
    # a copy held by two pipeline stages (the embedding with tied weights or MTP) counts half on each
    return per_stage // split * getattr(param, "moefold_pipeline_copies", 1)


@dataclass
class _ShardState:
    group: FlatGroup
    lo: int
    hi: int
    master: Tensor        # fp32 [hi - lo]
    exp_avg: Tensor
    exp_avg_sq: Tensor
    decay_mask: Tensor    # fp32 0/1
    norm_weight: Tensor   # fp32: 1 / replicas


class DistributedAdamW:
    """AdamW over ``sync``'s parameters, each rank updating only its shard of each reduction group.

    Args mirror ``torch.optim.AdamW``. ``step(lr, clip_coef)`` uses the gradients left by
    ``sync.finish()``. Collective: ``grad_norm()`` (world all-reduce) and ``step()`` (all-gather per group).
    """

    def __init__(self, sync: GradSync, dims: ParallelDims, *, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0,
                 decay_fn: Callable[[str, Tensor], bool] = decays) -> None:
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas={betas} must lie in [0, 1)")
        if not eps > 0:
            raise ValueError(f"eps={eps} must be > 0")
        if weight_decay < 0:
            raise ValueError(f"weight_decay={weight_decay} must be >= 0")
        self.sync, self.dims, self.betas, self.eps, self.weight_decay = sync, dims, betas, eps, weight_decay
        self.step_count = 0
        self.shards: list[_ShardState] = []
        for g in sync.groups:
            n, r = g.group_size, group_rank(g.group)
            size = g.numel // n
            lo, hi = r * size, (r + 1) * size
            flat = self._flat_params(g)
            decay = torch.zeros(g.numel, dtype=torch.float32, device=g.grad.device)
            weight = torch.zeros_like(decay)
            for name, p, off in zip(g.names, g.params, g.offsets):
                decay[off:off + p.numel()] = float(decays(name, p) and weight_decay > 0)
                weight[off:off + p.numel()] = 1.0 / replicas(p, n, dims)
            self.shards.append(_ShardState(g, lo, hi, flat[lo:hi].clone(), torch.zeros(size, device=flat.device),
                                           torch.zeros(size, device=flat.device), decay[lo:hi].clone(),
                                           weight[lo:hi].clone()))

    @staticmethod
    def _flat_params(g: FlatGroup) -> Tensor:
        flat = torch.zeros(g.numel, dtype=torch.float32, device=g.grad.device)
        for p, off in zip(g.params, g.offsets):
            flat[off:off + p.numel()] = p.detach().reshape(-1).float()
        return flat

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (master + moments + masks)."""
        return sum(t.numel() * t.element_size() for s in self.shards
                   for t in (s.master, s.exp_avg, s.exp_avg_sq, s.decay_mask, s.norm_weight))

    def grad_norm(self) -> Tensor:
        """Global L2 norm of the step's gradient (fp32 0-d tensor, identical on every rank)."""
        total = torch.zeros((), dtype=torch.float64, device=self.sync.groups[0].grad.device if self.shards else "cpu")
        for s in self.shards:
            g = s.group.grad[s.lo:s.hi]
            total += (g.double().square() * s.norm_weight.double()).sum()
        if self.dims.world_size > 1:
            dist.all_reduce(total)
        return total.sqrt().float()

    @torch.no_grad()
    def step(self, lr: float, clip_coef: float = 1.0) -> None:
        """One AdamW step on the owned shards with gradients scaled by ``clip_coef``; then every replica's
        parameters receive the new values."""
        self.step_count += 1
        beta1, beta2 = self.betas
        bc1 = 1 - beta1 ** self.step_count
        bc2_sqrt = math.sqrt(1 - beta2 ** self.step_count)
        for s in self.shards:
            grad = s.group.grad[s.lo:s.hi]
            if clip_coef != 1.0:
                grad = grad * clip_coef
            if self.weight_decay > 0:
                s.master.mul_(1 - lr * self.weight_decay * s.decay_mask)
            s.exp_avg.lerp_(grad, 1 - beta1)
            s.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (s.exp_avg_sq.sqrt() / bc2_sqrt).add_(self.eps)
            s.master.addcdiv_(s.exp_avg, denom, value=-lr / bc1)
        self.copy_master_to_params()

    @torch.no_grad()
    def copy_master_to_params(self) -> None:
        """All-gather the master shards of each group and write them into the (possibly bf16) parameters."""
        for s in self.shards:
            full = self.gather(s, s.master)
            for p, off in zip(s.group.params, s.group.offsets):
                p.copy_(full[off:off + p.numel()].view(p.shape))

    @staticmethod
    def gather(s: _ShardState, shard: Tensor) -> Tensor:
        """The group's full flat tensor from every rank's ``shard`` (collective over the group)."""
        n = s.group.group_size
        if n == 1:
            return shard
        out = torch.empty(s.group.numel, dtype=shard.dtype, device=shard.device)
        # equal contiguous shards: one all-gather straight into the flat buffer, no list of per-rank outputs
        # (all_gather_single is all_gather_into_tensor's newer name; the old one warns on recent torch)
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, shard.contiguous(), group=s.group.group)
        return out

    # -- layout-independent state: per parameter, the local (TP/EP-sharded) shape --------------
    def param_states(self) -> dict[str, dict[str, Tensor]]:
        """{param name: {"exp_avg", "exp_avg_sq", "master"}} in each parameter's local shape (gathered
        over the ZeRO group: collective). Checkpoints wrap these like the parameter itself."""
        out: dict[str, dict[str, Tensor]] = {}
        for s in self.shards:
            fulls = {k: self.gather(s, getattr(s, k)) for k in ("exp_avg", "exp_avg_sq", "master")}
            for name, p, off in zip(s.group.names, s.group.params, s.group.offsets):
                out[name] = {k: v[off:off + p.numel()].view(p.shape).clone() for k, v in fulls.items()}
        return out

    @torch.no_grad()
    def load_param_states(self, states: dict[str, dict[str, Tensor]], step_count: int) -> None:
        """Inverse of ``param_states`` (every rank passes the states of its local parameters)."""
        for s in self.shards:
            for key in ("exp_avg", "exp_avg_sq", "master"):
                flat = torch.zeros(s.group.numel, dtype=torch.float32, device=s.master.device)
                for name, p, off in zip(s.group.names, s.group.params, s.group.offsets):
                    if name not in states:
                        raise KeyError(f"optimizer state of parameter {name!r} is missing")
                    flat[off:off + p.numel()] = states[name][key].reshape(-1).float()
                getattr(s, key).copy_(flat[s.lo:s.hi])
        self.step_count = int(step_count)
