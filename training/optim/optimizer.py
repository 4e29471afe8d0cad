"""Megatron-style distributed AdamW: the library's ``torch.optim.AdamW`` on this rank's shard only.

``training.optim.buffers`` cuts each reduction group's flat buffers into buckets and gives rank r of the
group chunk r of every bucket; ``GradSync`` reduce-scatters the gradients into those chunks. Per
bucket, this rank holds a *slice*: the chunk's master values (the parameters' own buffer when they
already have the master dtype; an fp32 copy for bf16 parameters) and Adam's two moments. One
``torch.optim.AdamW`` (``fused``, else ``foreach``) updates them: its parameters are flat views of
the chunks, one per parameter piece, in two param groups, with and without weight decay
(``decays``). A step clips (one in-place multiply per chunk), runs AdamW, casts fp32 masters back
into bf16 parameters, and ``ParamSync`` all-gathers the buckets. Optimizer memory per rank is therefore
``1/n`` of the unpartitioned one (``state_bytes()``); world 1 and groups of one rank take no
collective and, with fp32 parameters, no copy: AdamW updates the parameters in place.

Precision (``OptimizerPrecision``, Megatron's flag names): main grads fp32 or bf16, master params
fp32, ``exp_avg`` / ``exp_avg_sq`` fp32 or bf16. ``torch.optim.AdamW`` needs its state in the dtype
of its parameters, so bf16 moments (and bf16 grads) are widened to fp32 for the update and the
moments narrowed back, one bucket at a time (one AdamW per bucket then): the fp32 copies live
only while their bucket steps.

Gradient norm: every element is counted once across the world (``grad_norm``): ``_foreach_norm``
over this rank's pieces, each squared norm weighted by 1 / the number of ranks that hold the same
piece (``replicas``: e.g. a norm weight replicated over tp), summed over the world.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moefold.parallel.dims import ParallelDims
from moefold.parallel.sharding import shards_of
from moefold.training.optim.buffers import Bucket, FlatGroup
from moefold.training.optim.grad_sync import GradSync
from moefold.training.optim.offload import HostOptimizer, host_device, offloaded_buckets
from moefold.training.optim.param_sync import ParamSync
from moefold.training.optim.precision import OptimizerPrecision
from moefold.training.optim.state_shards import ShardPieces


def decays(name: str, param: Tensor) -> bool:
    """Whether AdamW's weight decay applies: matrices only, never norms, biases or expert biases."""
    last = name.rsplit(".", 1)[-1].lower()
    lowered = name.lower()
    if param.dim() < 2 or last == "bias" or last.endswith("_bias") or "expert_bias" in lowered:
        return False
    return not any(m in lowered for m in ("norm.", "layernorm", "_norm", "norm_"))


def replicas(param: Tensor, group_numel: int, dims: ParallelDims) -> int:
    """How many ranks of one pipeline stage hold the same element of ``param`` after the group
    reduction and the partition: stage ranks / (group size * shard count)."""
    per_stage = dims.world_size // dims.pp
    split = group_numel
    for s in shards_of(param):
        split *= s.num
    if per_stage % split:
        raise ValueError(f"parameter of shape {tuple(param.shape)}: group size x shards = {split} does not "
                         f"divide the {per_stage} ranks of a stage")
    # a copy held by two pipeline stages (the embedding with tied weights or MTP) counts half on each
    return per_stage // split * getattr(param, "moefold_pipeline_copies", 1)


def norm_squared(grads: list[Tensor], weights: Tensor, device: torch.device) -> Tensor:
    """sum_i weights[i] * ||grads[i]||^2 (fp32 0-d tensor; zero without gradients)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32))
    return (norms.square() * weights).sum()


@dataclass(frozen=True)
class _Piece:
    """Elements ``[lo, hi)`` of parameter ``name`` (flattened local tensor), at ``at`` in its slice's chunk."""

    name: str
    param: nn.Parameter
    lo: int
    hi: int
    at: int
    decays: bool
    weight: float   # in the squared gradient norm: 1 / replicas

    def of(self, chunk: Tensor) -> Tensor:
        return chunk[self.at:self.at + self.hi - self.lo]


def _adamw(groups: list[dict], betas: tuple[float, float], eps: float) -> torch.optim.AdamW:
    """The library AdamW, fused where torch has a fused kernel for the device, else foreach."""
    try:
        return torch.optim.AdamW(groups, lr=0.0, betas=betas, eps=eps, fused=True)
    except RuntimeError:   # no fused kernel for this device type
        return torch.optim.AdamW(groups, lr=0.0, betas=betas, eps=eps, foreach=True)


class _Slice:
    """This rank's chunk of one bucket: master values, moments and gradient views, stepped by an ``_Update``.
    ``offloaded``: master, moments and a copy of the gradient live in host memory (``training.optim.offload``;
    on the CPU separate buffers all the same); ``device_grad`` is the gradient on the parameters' device (the norm
    reads it)."""

    def __init__(self, g: FlatGroup, b: Bucket, dims: ParallelDims, precision: OptimizerPrecision,
                 weight_decay: float, decay_fn: Callable[[str, Tensor], bool], offloaded: bool = False) -> None:
        lo, hi = g.owned(b)
        self.bucket = b
        self.param, self.grad = g.param_data[lo:hi], g.grad_data[lo:hi]
        self.device_grad = self.grad
        master_dtype = precision.dtype("main_params")
        device = host_device(self.param.device) if offloaded else self.param.device
        self.offloaded = offloaded
        if offloaded:
            self.grad = torch.empty(hi - lo, dtype=self.grad.dtype, device=device,
                                    pin_memory=self.param.device.type == "cuda")
        # FP8 primary weights hold FP8 values after each gather: their fp32 master must be a copy of its own
        self.separate_master = self.param.dtype != master_dtype or self.offloaded or g.fp8
        self.master = (torch.empty(hi - lo, dtype=master_dtype, device=device).copy_(self.param)
                       if self.separate_master else self.param)
        self.exp_avg = torch.zeros(hi - lo, dtype=precision.dtype("exp_avg"), device=device)
        self.exp_avg_sq = torch.zeros(hi - lo, dtype=precision.dtype("exp_avg_sq"), device=device)
        self.widen_grad = self.grad.dtype != master_dtype
        self.widen_moments = (self.exp_avg.dtype, self.exp_avg_sq.dtype) != (master_dtype, master_dtype)
        self.pieces = [_Piece(g.names[i], g.params[i], a, z, g.offsets[i] + a - lo,
                              decay_fn(g.names[i], g.params[i]) and weight_decay > 0,
                              1.0 / replicas(g.params[i], g.size, dims))
                       for i, a, z in g.pieces(b)]
        self.masters = [p.of(self.master) for p in self.pieces]
        self.opt: torch.optim.AdamW | None = None
        self._wide: tuple[Tensor, Tensor] | None = None

    def attach(self, opt: torch.optim.AdamW) -> None:
        """Give ``opt`` (whose params include ``self.masters``) its state: the state torch would create lazily,
        made now so that it exists (and is checkpointable) before the first step, in this slice's buffers."""
        self.opt = opt
        fused = opt.defaults["fused"]
        for p, m in zip(self.pieces, self.masters):
            step = torch.zeros((), dtype=torch.float32, device=m.device if fused else "cpu")
            opt.state[m] = {"step": step, "exp_avg": p.of(self.exp_avg), "exp_avg_sq": p.of(self.exp_avg_sq)}
            if not self.widen_grad:
                m.grad = p.of(self.grad)

    def before_step(self, clip_coef: float) -> None:
        """Clip; give AdamW fp32 views of bf16 gradients / moments (for this slice only, while it steps)."""
        if clip_coef != 1.0:
            self.grad.mul_(clip_coef)
        if self.widen_grad:
            grad = self.grad.to(self.master.dtype)
            for p, m in zip(self.pieces, self.masters):
                m.grad = p.of(grad)
        if self.widen_moments:
            self._wide = (self.exp_avg.to(self.master.dtype), self.exp_avg_sq.to(self.master.dtype))
            self._point_states(*self._wide)

    def after_step(self) -> None:
        """Narrow the moments back, drop widened gradients, cast the master into the parameters."""
        if self._wide is not None:
            self.exp_avg.copy_(self._wide[0])
            self.exp_avg_sq.copy_(self._wide[1])
            self._point_states(self.exp_avg, self.exp_avg_sq)
            self._wide = None
        if self.widen_grad:
            for m in self.masters:
                m.grad = None
        if self.separate_master and not self.offloaded:   # offloaded: HostOptimizer copies on a side stream
            self.param.copy_(self.master)

    def _point_states(self, exp_avg: Tensor, exp_avg_sq: Tensor) -> None:
        for p, m in zip(self.pieces, self.masters):
            state = self.opt.state[m]
            state["exp_avg"], state["exp_avg_sq"] = p.of(exp_avg), p.of(exp_avg_sq)

    def set_step(self, step: int) -> None:
        for m in self.masters:
            self.opt.state[m]["step"].fill_(float(step))

    @property
    def saves_master(self) -> bool:
        """A master that differs from the parameter in dtype (checkpoints keep it as ``optim.<param>.master``; an
        offloaded fp32 master is the parameter's own value and is not saved twice)."""
        return self.master.dtype != self.param.dtype

    def state_tensors(self) -> dict[str, Tensor]:
        out = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.saves_master:
            out["master"] = self.master
        return out


class _Update:
    """One ``torch.optim.AdamW`` over the pieces of ``slices`` (a decay and a no-decay param group)."""

    def __init__(self, slices: list[_Slice], betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        self.slices = [s for s in slices if s.pieces]
        pairs = [(p, m) for s in self.slices for p, m in zip(s.pieces, s.masters)]
        groups = [{"params": [m for p, m in pairs if p.decays == d], "weight_decay": weight_decay if d else 0.0}
                  for d in (True, False)]
        self.opt = _adamw([grp for grp in groups if grp["params"]], betas, eps) if pairs else None
        for s in self.slices:
            s.attach(self.opt)

    def step(self, lr: float, clip_coef: float) -> None:
        if self.opt is None:
            return
        for s in self.slices:
            s.before_step(clip_coef)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        for s in self.slices:
            s.after_step()


class DistributedAdamW:
    """AdamW over ``sync``'s parameters, each rank updating only its chunks (see the module docstring).

    Args mirror ``torch.optim.AdamW``. ``step(lr, clip_coef)`` uses the gradients left by
    ``sync.finish()``. ``model`` and ``overlap_param_gather``: the parameter all-gather waits in the
    model's forward pre-hooks instead of at the end of ``step`` (``training.optim.param_sync``).
    ``cpu_offload_fraction``: keep that share of this rank's states in host memory and update it on the CPU
    (``training.optim.offload``; needs ``model``, whose forward waits for those parameters); None: none.
    ``whole_update(lr, clip_coef)``: updates the groups laid out whole (``FlatGroup.whole``: Muon's matrices,
    ``training.optim.muon``), which AdamW leaves alone, before the parameters are gathered.
    Collective: ``grad_norm()`` (world all-reduce), ``step()`` (the parameter all-gathers), ``loaded()``.
    """

    def __init__(self, sync: GradSync, dims: ParallelDims, *, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, precision: OptimizerPrecision | None = None,
                 decay_fn: Callable[[str, Tensor], bool] = decays, model: nn.Module | None = None,
                 overlap_param_gather: bool = False, cpu_offload_fraction: float | None = None,
                 whole_update: Callable[[float, float], None] | None = None) -> None:
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas={betas} must lie in [0, 1)")
        if not eps > 0:
            raise ValueError(f"eps={eps} must be > 0")
        if weight_decay < 0:
            raise ValueError(f"weight_decay={weight_decay} must be >= 0")
        precision = precision or OptimizerPrecision()
        if sync.grad_dtype != precision.dtype("main_grads"):
            raise ValueError(f"GradSync keeps {sync.grad_dtype} gradients but main_grads_dtype="
                             f"{precision.main_grads_dtype!r}")
        self.sync, self.dims, self.precision = sync, dims, precision
        self.step_count = 0
        self.whole_update = whole_update
        device = sync.groups[0].grad_data.device if sync.groups else torch.device("cpu")
        adam_groups = [g for g in sync.groups if not g.whole]
        host = set() if cpu_offload_fraction is None else offloaded_buckets(adam_groups, cpu_offload_fraction)
        self.slices = [_Slice(g, b, dims, precision, weight_decay, decay_fn, offloaded=id(b) in host)
                       for g in adam_groups for b in g.buckets]
        # one AdamW for the device's slices and one for the host's; bucket by bucket where bf16 states or
        # gradients are widened to fp32 for the update, so that the fp32 copies exist for one bucket at a time
        widening = any(s.widen_grad or s.widen_moments for s in self.slices)
        parts = {False: [s for s in self.slices if not s.offloaded], True: [s for s in self.slices if s.offloaded]}
        updates = {k: [_Update(part, betas, eps, weight_decay) for part in ([[s] for s in v] if widening else [v])]
                   for k, v in parts.items()}
        self.updates = updates[False]
        self.host = HostOptimizer(parts[True], updates[True] if parts[True] else [], [s.bucket for s in parts[True]],
                                  device)
        if parts[True] and model is None:
            raise ValueError("DistributedAdamW(cpu_offload_fraction=...) needs the model: its forward waits for the "
                             "parameters the CPU updates")
        self.param_sync = ParamSync(sync.groups, model, overlap=overlap_param_gather,
                                    deferred={id(s.bucket) for s in parts[True]}, wait_deferred=self.host.wait)
        pieces = [(s, p) for s in self.slices for p in s.pieces]
        # FP8 buckets quantise the fp32 master chunk (the parameters' chunk when they are their own master)
        owners = [(g, b) for g in adam_groups for b in g.buckets]
        self.param_sync.masters = {id(b): s.master for (g, b), s in zip(owners, self.slices) if g.fp8}
        self._norm_grads = [p.of(s.device_grad) for s, p in pieces]
        self._norm_weights = torch.tensor([p.weight for _, p in pieces], dtype=torch.float32, device=device)
        self._device = device

    # ------------------------------------------------------------------------------- the step
    def grad_norm(self, extra: Tensor | None = None) -> Tensor:
        """Global L2 norm of the step's gradient (fp32 0-d tensor, identical on every rank). ``extra``: this rank's
        weighted squared norm of the gradients it holds outside AdamW's slices (Muon's matrices)."""
        total = norm_squared(self._norm_grads, self._norm_weights, self._device)
        if extra is not None:
            total = total + extra
        if self.dims.world_size > 1:
            dist.all_reduce(total)
        return total.sqrt()

    @torch.no_grad()
    def step(self, lr: float, clip_coef: float = 1.0) -> None:
        """One AdamW step on this rank's chunks with gradients scaled by ``clip_coef``; then every replica's
        parameters receive the new values (now, or during the next forward with overlap)."""
        self.param_sync.wait_all()   # a gather still in flight must not race the update of its bucket
        self.step_count += 1
        self.host.start(lr, clip_coef)   # offloaded slices: on the CPU, in a worker thread, meanwhile
        for update in self.updates:
            update.step(lr, clip_coef)
        if self.whole_update is not None:
            self.whole_update(lr, clip_coef)
        self.param_sync.launch()

    def finish_param_sync(self) -> None:
        """Wait for parameter gathers still in flight (before reading parameters outside a forward)."""
        self.param_sync.wait_all()

    # ------------------------------------------------------------------------------- memory
    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank: moments, and master copies where they are separate."""
        return sum(self.state_breakdown().values())

    def state_breakdown(self, offloaded: bool = False) -> dict[str, int]:
        """{"master", "exp_avg", "exp_avg_sq"}: bytes held by this rank on the device (``offloaded``: in host
        memory, the optimizer offload's; an offloaded fp32 master counted there too)."""
        out = {"master": 0, "exp_avg": 0, "exp_avg_sq": 0}
        for s in self.slices:
            if s.offloaded != offloaded:
                continue
            tensors = {**s.state_tensors(), **({"master": s.master} if s.offloaded else {})}
            for k, t in tensors.items():
                out[k] += t.numel() * t.element_size()
        return out

    def host_bytes(self) -> int:
        """Bytes the optimizer offload keeps in host memory: masters, moments and gradient copies."""
        return (sum(self.state_breakdown(offloaded=True).values())
                + sum(s.grad.nbytes for s in self.slices if s.offloaded))

    def close(self) -> None:
        """Finish and stop the optimizer offload's worker thread (none without offload)."""
        self.param_sync.wait_all()
        self.host.close()

    # ------------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self, keys: set[str] | None = None) -> dict[str, ShardPieces]:
        """{"optim.<param>.<exp_avg | exp_avg_sq | master>": this rank's pieces} (views: loading into them
        fills the state in place). ``master`` only where it is separate from the parameter. With ``keys``
        (a checkpoint's), only the entries it has."""
        out = {}
        for s in self.slices:
            for key, chunk in s.state_tensors().items():
                for p in s.pieces:
                    fqn = f"optim.{p.name}.{key}"
                    if keys is None or fqn in keys:
                        out[fqn] = ShardPieces.of_flat_range(p.param, p.lo, p.hi, p.of(chunk))
        return out

    def master_fallback(self, keys: set[str]) -> dict[str, ShardPieces]:
        """What a checkpoint with ``keys`` offers beyond ``checkpoint_state(keys)`` for the master values: a
        separate master missing from it (saved by an fp32 run) comes from ``model.<param>``; parameters that
        are their own master take ``optim.<param>.master`` where a bf16 run saved one (more precise than its
        bf16 parameters). Load these after the model."""
        out = {}
        for s in self.slices:
            for p in s.pieces:
                master = f"optim.{p.name}.master"
                if s.separate_master and master not in keys:
                    out[f"model.{p.name}"] = ShardPieces.of_flat_range(p.param, p.lo, p.hi, p.of(s.master))
                elif not s.separate_master and master in keys:
                    out[master] = ShardPieces.of_flat_range(p.param, p.lo, p.hi, p.of(s.master))
        return out

    @torch.no_grad()
    def loaded(self, step_count: int) -> None:
        """After a checkpoint was loaded into ``checkpoint_state()``/``master_fallback()``: set AdamW's step,
        make the parameters the (cast) masters and gather them. Collective."""
        self.step_count = int(step_count)
        for s in self.slices:
            if s.pieces:
                s.set_step(self.step_count)
            if s.separate_master:
                s.param.copy_(s.master)
        self.param_sync.launch()
        self.param_sync.wait_all()
