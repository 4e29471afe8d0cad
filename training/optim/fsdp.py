"""FSDP with expert parallelism (``--use-torch-fsdp2``): parameters, gradients and optimizer states sharded by
PyTorch's ``fully_shard`` (FSDP2, the engine TorchTitan uses), in place of the distributed optimizer.

The sharding itself is applied by the execution pass (``execution.fsdp.shard_model``); this module refuses what FSDP
does not compose with (``check_fsdp``), and holds the gradient sync and the optimizer over the sharded parameters.
The units and meshes (the experts over edp, the tp-replicated weights with partial gradients over tp x cp x dp,
the rest of each block, the embedding and the head over dp x cp) are described in ``execution.fsdp``.

moefold's own tensor, expert and pipeline parallelism are untouched: FSDP shards each rank's *local* tensor (its
tp / ep / etp shard) along one dimension over the unit's mesh (``Shard(0)``, or the first dimension its mesh size
divides), so tp, sp, cp, ep/etp and pp compose with it. Gradients are summed over the mesh and divided by dp
(``set_gradient_divide_factor``; on gloo, which has no ``ReduceOp.PREMUL_SUM``, as a SUM followed by a division:
``set_force_sum_reduction_for_comms``), the world-1 gradient as with the distributed optimizer; each micro-batch's
backward reduce-scatters its gradients, which accumulate sharded. ``reshard_after_forward`` follows TorchTitan's
default: every unit but the last block frees its gathered parameters after its forward (the last block's are
needed at once by the backward), and with pipeline parallelism no unit does (several micro-batches' forwards run
before their backwards). The embedding copy that two pipeline stages hold (tied head, MTP) has its sharded
gradient summed over the two stages (``finish``).

The optimizer is ``torch.optim.AdamW`` over the sharded parameters (DTensors; fused kernel where torch has one,
else foreach), with the distributed optimizer's weight-decay groups, global gradient norm (each element counted
once over the world) and clipping. With ``--bf16`` the sharded parameters are the fp32 masters and FSDP's
``MixedPrecisionPolicy`` gathers them in bf16 (the routers, fp32 in the bf16 model, in fp32); gradients are
reduced in the main-grads dtype. Checkpoints keep the distributed optimizer's keys (``model.<p>``,
``optim.<p>.exp_avg|exp_avg_sq``, ``optim.<p>.master`` for bf16 models), each rank writing its FSDP shard as a box
of the parameter's full tensor (``training.optim.state_shards.ShardPieces``), so DCP reshards between FSDP, the
distributed optimizer and world 1 in either direction.

What FSDP does not compose with here is refused before any rank starts (``check_fsdp``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from moefold.execution.fsdp import MESH_OF_KIND, FSDPSharding
from moefold.parallel.dims import ParallelDims
from moefold.parallel.groups import Group
from moefold.parallel.sharding import full_shape, reduction_kind
from moefold.training.optim.optimizer import decays, replicas
from moefold.training.optim.state_shards import ShardPieces, local_offsets


def check_fsdp(t, options, world_size: int) -> None:
    """ValueError (one line, naming the flags) for what ``--use-torch-fsdp2`` does not compose with: ``t`` the
    ``TrainConfig``, ``options`` the ``ModelOptions``."""
    if not t.use_torch_fsdp2:
        return
    refused = [
        (world_size == 1, "a world of one rank: there is nothing to shard (run without it)"),
        (t.optimizer_cpu_offload, "--optimizer-cpu-offload: the CPU update works on the distributed optimizer's "
                                  "flat shards; use one of the two"),
        (t.overlap_param_gather, "--overlap-param-gather: FSDP gathers each unit's parameters before its forward "
                                 "itself (and prefetches the next)"),
        (not t.overlap_grad_reduce, "--no-overlap-grad-reduce: FSDP reduce-scatters each unit's gradients during "
                                    "the backward"),
        (t.exp_avg_dtype != "fp32" or t.exp_avg_sq_dtype != "fp32",
         "--exp-avg-dtype/--exp-avg-sq-dtype bf16: torch.optim.AdamW keeps its moments in the fp32 dtype of the "
         "sharded parameters; use the distributed optimizer for bf16 moments"),
        (t.compile, "--compile: the blocks are compiled before sharding, so FSDP's hooks would be traced into them"),
        (options.fp8.enabled, "FP8 (--fp8-format): FP8 weights need float8 all-gathers, which moefold's FSDP "
                              "units do not do"),
    ]
    for bad, why in refused:
        if bad:
            raise ValueError(f"--use-torch-fsdp2 with {why}")


def _sharded(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    for name, p in model.named_parameters():
        if p.requires_grad:
            yield name, p


def _pieces(param: DTensor, local: Tensor) -> ShardPieces:
    """``local`` (this rank's FSDP shard of ``param``, or of its state) as a box of the parameter's full tensor."""
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    base = local_offsets(param)
    boxes = []
    if local.numel():
        boxes.append((torch.Size(b + o for b, o in zip(base, offset)), torch.Size(shape), local.view(shape)))
    return ShardPieces(torch.Size(full_shape(param)), boxes)


class FSDPGradSync:
    """The ``GradSync`` role under FSDP2: the step's gradients are FSDP's sharded ``param.grad``. Collective:
    ``finish`` (the pipeline copies' sum), ``gathered_grads``."""

    def __init__(self, model: nn.Module, dims: ParallelDims, units: list[FSDPModule], copies_group: Group) -> None:
        self.model, self.dims, self.units = model, dims, units
        self.params = dict(_sharded(model))
        self.copies_group = copies_group
        self.groups: list = []   # no flat buffers
        self.overlap = True

    def start_step(self, num_micro: int) -> None:
        """Drop the previous step's sharded gradients (each micro-batch's backward adds its reduce-scattered part)."""
        del num_micro
        for p in self.params.values():
            p.grad = None

    def finish(self) -> None:
        """Sum the sharded gradient of parameters two pipeline stages hold over those stages."""
        if self.copies_group is None:
            return
        for p in self.params.values():
            if getattr(p, "moefold_pipeline_copies", 1) > 1 and p.grad is not None:
                dist.all_reduce(p.grad.to_local(), group=self.copies_group)

    @property
    def launched_early(self) -> int:
        """Units whose gradients FSDP reduce-scattered during the backward: all of them."""
        return len(self.units)

    @torch.no_grad()
    def gathered_grads(self) -> dict[str, Tensor]:
        """{name: the reduced gradient in the parameter's local (tp/ep) shape}: each shard gathered over its mesh."""
        out = {}
        for name, p in self.params.items():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            out[name] = grad.full_tensor().clone()
        return out

    def param_bytes(self) -> int:
        """Bytes of this rank's sharded parameters (FSDP pads each shard to an equal size)."""
        return sum(p.to_local().untyped_storage().nbytes() for p in self.params.values())

    def grad_bytes(self) -> int:
        """Bytes of this rank's sharded gradients (the parameters' dtype, their unpadded shard size)."""
        return sum(p.to_local().numel() * p.element_size() for p in self.params.values())


class FSDPAdamW:
    """The ``DistributedAdamW`` role under FSDP2: ``torch.optim.AdamW`` over the sharded parameters (module docstring).
    Collective: ``grad_norm`` (world all-reduce)."""

    def __init__(self, sync: FSDPGradSync, dims: ParallelDims, *, betas: tuple[float, float], eps: float,
                 weight_decay: float, compute_dtypes: dict[str, torch.dtype]) -> None:
        self.sync, self.dims = sync, dims
        self.step_count = 0
        self.slices: list = []
        self.compute_dtypes = compute_dtypes
        params = sync.params
        groups = [{"params": [p for n, p in params.items() if decays(n, p) == d],
                   "weight_decay": weight_decay if d else 0.0} for d in (True, False)]
        groups = [g for g in groups if g["params"]]
        try:
            self.opt = torch.optim.AdamW(groups, lr=0.0, betas=betas, eps=eps, fused=True)
        except RuntimeError:
            self.opt = torch.optim.AdamW(groups, lr=0.0, betas=betas, eps=eps, foreach=True)
        fused = self.opt.defaults["fused"]
        for p in params.values():   # the state torch would make at the first step, now (checkpointable at once)
            local = p.to_local()
            step = torch.zeros((), dtype=torch.float32, device=local.device if fused else "cpu")
            self.opt.state[p] = {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        self.names = {id(p): n for n, p in params.items()}
        self._weights = {n: 1.0 / replicas(p, p.device_mesh.size(), dims) for n, p in params.items()}

    def _local_grads(self) -> list[tuple[str, Tensor]]:
        return [(n, p.grad.to_local()) for n, p in self.sync.params.items() if p.grad is not None]

    def grad_norm(self) -> Tensor:
        """Global L2 norm of the step's gradient (fp32 0-d tensor, identical on every rank)."""
        grads = self._local_grads()
        device = next(iter(self.sync.params.values())).to_local().device
        total = torch.zeros((), dtype=torch.float32, device=device)
        if grads:
            norms = torch.stack(torch._foreach_norm([g for _, g in grads], 2.0, dtype=torch.float32))
            weights = torch.tensor([self._weights[n] for n, _ in grads], dtype=torch.float32, device=device)
            total = (norms.square() * weights).sum()
        dist.all_reduce(total)
        return total.sqrt()

    @torch.no_grad()
    def step(self, lr: float, clip_coef: float = 1.0) -> None:
        self.step_count += 1
        if clip_coef != 1.0:
            torch._foreach_mul_([g for _, g in self._local_grads()], clip_coef)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()

    def finish_param_sync(self) -> None:
        """Nothing in flight between steps: FSDP gathers parameters in each unit's forward."""

    def close(self) -> None:
        """Nothing to release (the distributed optimizer's offload worker has no counterpart here)."""

    # ------------------------------------------------------------------------------- memory
    def state_breakdown(self, offloaded: bool = False) -> dict[str, int]:
        """{"master", "exp_avg", "exp_avg_sq"}: this rank's bytes (the fp32 sharded parameters are the masters:
        counted as parameters)."""
        out = {"master": 0, "exp_avg": 0, "exp_avg_sq": 0}
        if offloaded:
            return out
        for state in self.opt.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                out[k] += state[k].to_local().numel() * state[k].element_size()
        return out

    def state_bytes(self) -> int:
        return sum(self.state_breakdown().values())

    def host_bytes(self) -> int:
        return 0

    # ------------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self, keys: set[str] | None = None) -> dict[str, ShardPieces]:
        """To save (``keys`` None): the distributed optimizer's keys for this rank's shards, ``model.<p>`` (the model
        dtype: a bf16 copy of an fp32 master), ``optim.<p>.exp_avg|exp_avg_sq`` and, for bf16 models,
        ``optim.<p>.master``; they replace ``build_state``'s own entries for the parameters. To load (the keys of
        a checkpoint): ``load_state(keys)``."""
        if keys is not None:
            return self.load_state(keys)
        out = {}
        for name, p in self.sync.params.items():
            state = self.opt.state[p]
            dtype = self.compute_dtypes[name]
            entries = {f"optim.{name}.exp_avg": state["exp_avg"].to_local(),
                       f"optim.{name}.exp_avg_sq": state["exp_avg_sq"].to_local()}
            if dtype != p.dtype:
                entries[f"model.{name}"] = p.to_local().to(dtype)
                entries[f"optim.{name}.master"] = p.to_local()
            else:
                entries[f"model.{name}"] = p.to_local()
            for key, local in entries.items():
                out[key] = _pieces(p, local)
        return out

    def load_state(self, keys: set[str]) -> dict[str, ShardPieces]:
        """What a load reads into: the moments, and the fp32 shards from ``optim.<p>.master`` where the checkpoint
        has one (a bf16 run's, more precise), else from ``model.<p>``."""
        out = {}
        for name, p in self.sync.params.items():
            state = self.opt.state[p]
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"optim.{name}.{k}"] = _pieces(p, state[k].to_local())
            master = f"optim.{name}.master"
            out[master if master in keys else f"model.{name}"] = _pieces(p, p.to_local())
        return out

    def master_fallback(self, keys: set[str]) -> dict[str, ShardPieces]:
        return {}

    @torch.no_grad()
    def loaded(self, step_count: int) -> None:
        self.step_count = int(step_count)
        for state in self.opt.state.values():
            state["step"].fill_(float(step_count))


def build_fsdp(model: nn.Module, config, dims: ParallelDims, copies_group: Group, sharding: FSDPSharding,
               ) -> tuple[FSDPGradSync, FSDPAdamW]:
    """The gradient sync and optimizer of ``model``, sharded by the execution pass (``sharding``: what
    ``execution.fsdp.shard_model`` returned), for ``config`` (a ``RunConfig``). Collective."""
    t = config.train
    sync = FSDPGradSync(model, dims, sharding.units, copies_group)
    optimizer = FSDPAdamW(sync, dims, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                          weight_decay=t.weight_decay, compute_dtypes=sharding.compute_dtypes)
    return sync, optimizer


def describe_fsdp(sync: FSDPGradSync, optimizer: FSDPAdamW) -> str:
    """The start-up line under FSDP2: this rank's sharded bytes and its units' meshes."""
    mib = lambda n: f"{n / 2**20:.1f} MiB"
    states = optimizer.state_breakdown()
    meshes: dict[str, int] = {}
    for p in sync.params.values():
        kind = reduction_kind(p)
        meshes[f"{kind} over {MESH_OF_KIND[kind]} ({p.device_mesh.size()})"] = 1
    return (f"memory (FSDP2): sharded params {mib(sync.param_bytes())}, grads {mib(sync.grad_bytes())}, optimizer "
            f"{mib(sum(states.values()))} (exp_avg {mib(states['exp_avg'])}, exp_avg_sq {mib(states['exp_avg_sq'])})"
            f"; units {len(sync.units)}: {', '.join(meshes)}")

