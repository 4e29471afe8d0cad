"""FSDP2 applied to a built model (``--use-torch-fsdp2``): PyTorch's ``fully_shard`` unit by unit, the last step of
the execution pass (``execution.apply``), after the model's weights are initialised or loaded. The gradient sync and
optimizer over the sharded parameters are ``training.optim.fsdp``.

Units and meshes (``shard_model``), the reduction kinds of ``training.optim.buffers`` as DeviceMesh sub-meshes of
``ParallelDims`` (built with ``torch.distributed.device_mesh``):

- the routed experts of each MoE layer (``GroupedExperts``: expert weights) over the expert data-parallel group
  ``edp`` (``expert_mesh["edp"]``);
- the modules whose own weights are replicated over tp with partial gradients (sequence-parallel norms, routers,
  MLA's replicated down-projections, the shared experts' gate: the ``sp`` kind) as one unit per block over
  ``tp x cp x dp`` (``dense_mesh["tp_cp_dp"]``): FSDP's reduce-scatter over that mesh is the sum over tp, cp and dp
  the distributed optimizer does for them;
- the rest of each transformer block (and of each MTP module), the embedding, and the final norm with the output
  head (one unit with the embedding when the head is tied to it) over ``dp x cp`` (``dense_mesh["dp_cp"]``); the
  decoder (or pipeline stage) itself is the root.

moefold's own tensor, expert and pipeline parallelism are untouched: FSDP shards each rank's *local* tensor along one
dimension over the unit's mesh (``Shard(0)``, or the first dimension its mesh size divides). Gradients are summed over
the mesh and divided by dp (``set_gradient_divide_factor``; on gloo, which has no ``ReduceOp.PREMUL_SUM``, as a SUM
followed by a division). ``reshard_after_forward`` follows TorchTitan's default: every unit but the last block frees
its gathered parameters after its forward, and with pipeline parallelism no unit does. With bf16 parameters the
sharded parameters become the fp32 masters, gathered in bf16 by FSDP's ``MixedPrecisionPolicy`` (the routers, fp32
in the bf16 model, in fp32); gradients are reduced in ``reduce_dtype``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from moefold.parallel.dims import ParallelDims
from moefold.parallel.sharding import reduction_kind

MESH_OF_KIND = {"dense": "dp_cp", "sp": "tp_cp_dp", "expert": "edp"}


@dataclass(frozen=True)
class FSDPPlan:
    """How to shard: ``reduce_dtype`` the gradients' reduction dtype (the main-grads dtype), ``pipelined`` whether
    the model is a pipeline stage (no unit reshards after its forward)."""

    reduce_dtype: torch.dtype
    pipelined: bool


@dataclass(frozen=True)
class FSDPSharding:
    """What ``shard_model`` did: its units (the root last) and each parameter's dtype before sharding, by name
    (the compute dtype the optimizer's checkpoint keys follow)."""

    units: list[FSDPModule]
    compute_dtypes: dict[str, torch.dtype]


def _meshes(dims: ParallelDims) -> dict[str, object]:
    """{reduction kind: the 1-D DeviceMesh its units shard over} (the flattened sub-meshes of ``ParallelDims``)."""
    if dims.dense_mesh is None:
        raise ValueError("--use-torch-fsdp2 needs torch.distributed (a world of more than one rank)")
    return {"dense": dims.dp_cp_mesh, "sp": dims.tp_cp_dp_mesh, "expert": dims.expert_mesh["edp"]}


def _shard_dim(n: int):
    """FSDP's ``shard_placement_fn``: the first dimension ``n`` divides (no padding), else dim 0."""
    def placement(p: Tensor) -> Shard:
        return Shard(next((d for d in range(p.dim()) if p.shape[d] % n == 0), 0)) if p.dim() else Shard(0)
    return placement


class _Wrapper:
    """Applies ``fully_shard`` unit by unit (module docstring), keeping moefold's parameter attributes."""

    def __init__(self, dims: ParallelDims, reduce_dtype: torch.dtype, reshard: bool, dtypes: dict[int, torch.dtype],
                 force_sum: bool) -> None:
        self.meshes = _meshes(dims)
        self.dp = dims.dp
        self.reduce_dtype = reduce_dtype
        self.reshard, self.dtypes, self.force_sum = reshard, dtypes, force_sum
        self.done: set[int] = set()       # ids of parameters already in a unit
        self.units: list[FSDPModule] = []
        self.mesh_size: dict[nn.Module, int] = {}

    def _free(self, module: nn.Module, recurse: bool = True) -> list[nn.Parameter]:
        return [p for p in module.parameters(recurse=recurse) if id(p) not in self.done]

    def unit(self, modules: nn.Module | list[nn.Module], kind: str, reshard: bool | None = None,
             root: bool = False) -> None:
        mods = modules if isinstance(modules, list) else [modules]
        params = {id(p): p for m in mods for p in self._free(m)}
        if not params and not root:
            return
        dtypes = {self.dtypes[i] for i in params}
        if len(dtypes) > 1:
            raise ValueError(f"an FSDP unit of {[type(m).__name__ for m in mods]} mixes parameter dtypes {dtypes}")
        compute = dtypes.pop() if dtypes else torch.float32
        mesh = self.meshes[kind]
        policy = MixedPrecisionPolicy(param_dtype=None if compute == torch.float32 else compute,
                                      reduce_dtype=self.reduce_dtype, cast_forward_inputs=False)
        attrs = {i: {k: v for k, v in vars(p).items() if k.startswith("moefold_")} for i, p in params.items()}
        before = {id(m): dict(m.named_parameters(recurse=True)) for m in mods}
        fully_shard(modules, mesh=mesh, reshard_after_forward=self.reshard if reshard is None else reshard,
                    mp_policy=policy, shard_placement_fn=_shard_dim(mesh.size()))
        for m in mods:   # the DTensor parameters that replaced them get moefold's attributes back
            for name, new in m.named_parameters(recurse=True):
                old = before[id(m)].get(name)
                if old is not None and id(old) in attrs:
                    for k, v in attrs[id(old)].items():
                        setattr(new, k, v)
                    self.dtypes[id(new)] = self.dtypes[id(old)]
                    self.done.add(id(new))
        self.done.update(params)
        for m in mods:
            self.units.append(m)
            self.mesh_size[m] = mesh.size()

    def block(self, top: nn.Module, reshard: bool | None = None) -> None:
        """``top`` and what it holds: its experts (edp), its sp-kind owners (tp x cp x dp, by dtype), the rest."""
        for m in top.modules():   # the routed experts (``moe.experts.GroupedExperts``: expert-kind weights only)
            own = self._free(m, recurse=False)
            if own and all(reduction_kind(p) == "expert" for p in own):
                self.unit(m, "expert", reshard)
        owners = [m for m in top.modules() if any(reduction_kind(p) == "sp" for p in self._free(m, recurse=False))]
        for owner in owners:   # an owner's dense children (e.g. the shared experts' projections) go first
            children = [c for c in owner.children() if any(reduction_kind(p) == "dense" for p in self._free(c))]
            if children:
                self.unit(children, "dense", reshard)
        by_dtype: dict[torch.dtype, list[nn.Module]] = {}
        for owner in owners:
            dtype = self.dtypes[id(self._free(owner, recurse=False)[0])]
            by_dtype.setdefault(dtype, []).append(owner)
        for group in by_dtype.values():
            self.unit(group, "sp", reshard)
        self.unit(top, "dense", reshard)


def shard_model(model: nn.Module, dims: ParallelDims, plan: FSDPPlan) -> FSDPSharding:
    """Apply FSDP2 to ``model`` (a ``MoEDecoder`` or a pipeline stage of one) in place; returns its units, the root
    last, and the parameters' dtypes before. bf16 parameters become fp32 sharded masters gathered in bf16 (module
    docstring). Collective over each unit's mesh."""
    compute = {n: p.dtype for n, p in model.named_parameters()}
    pipelined = plan.pipelined
    dtypes = {}
    for p in model.parameters():
        dtypes[id(p)] = p.dtype
        if p.dtype != torch.float32:
            p.data = p.data.float()
    gloo = dist.get_backend(dims.dp_cp_group or dist.group.WORLD) == "gloo"
    w = _Wrapper(dims, plan.reduce_dtype, reshard=not pipelined, dtypes=dtypes, force_sum=gloo)
    blocks = [b for b in model.layers.values()]
    for k, block in enumerate(blocks):
        w.block(block, reshard=False if k == len(blocks) - 1 and not pipelined else None)
    for mtp in model.mtp:   # its final norm runs outside its forward (the decoder's MTP loss): a unit of its own
        w.block(mtp.block)
        w.block(mtp.final_layernorm)
        w.block(mtp)
    tied = model.output_head is not None and model.output_head.tied_to is not None
    if model.embed_tokens is not None and not tied:
        w.block(model.embed_tokens)
    if model.norm is not None:
        w.block(model.norm)
    if tied:   # the head reads the embedding's weight: one unit
        w.unit([model.embed_tokens, model.output_head], "dense")
    elif model.output_head is not None:
        w.block(model.output_head)
    w.unit(model, "dense", root=True)   # the root: whatever is left (nothing, normally)
    # the embedding's output is a view; nothing modifies it in place (the blocks' residual adds are out of place)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPVocabParallelEmbedding\) returned a view")
    fully_shard.state(model)._lazy_init()   # the root even where a pipeline stage calls its parts, not forward
    for m in w.units:
        m.set_gradient_divide_factor(float(dims.dp))
        # gloo has no PREMUL_SUM: a SUM, then the division. Not on a mesh of one rank, where torch 2.13 divides
        # both in its copy and after it (FSDP2's foreach_reduce), and no collective runs anyway.
        if w.force_sum and m in w.mesh_size and w.mesh_size[m] > 1:
            m.set_force_sum_reduction_for_comms(True)
    return FSDPSharding(w.units, compute)


def fsdp_units(model: nn.Module) -> Iterable[FSDPModule]:
    """The FSDP units of a sharded model (tests, diagnostics)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


__all__ = ["MESH_OF_KIND", "FSDPPlan", "FSDPSharding", "fsdp_units", "shard_model"]
