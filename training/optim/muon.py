"""Muon for the matrices, AdamW for the rest, on the distributed optimizer's buffers (``--optimizer muon``).

As Megatron-Core's Muon (``TensorParallelMuon`` in its ``LayerWiseDistributedOptimizer``, flags ``--muon-*``) and
TorchTitan's DistMuon: every 2-D weight (``is_muon_matrix``: attention and MLP projections, MTP's ``eh_proj``, and
each expert's matrices on their own, gate and up apart) takes Muon's step; embeddings, the output layer, norms,
routers, biases and convolution kernels take AdamW's (``DistributedAdamW``, with the same lr schedule). Per matrix
``W`` with reduced gradient ``G`` (Megatron's order and EMA form)::

    W <- W (1 - lr wd)                                   decoupled weight decay
    M <- beta M + (1 - beta) G                           momentum (--muon-momentum)
    U <- G + beta (M - G)  if --muon-use-nesterov  else M
    W <- W - lr * extra * scale(rows, cols) * NS(U)      training.optim.newton_schulz

moefold's attention keeps q, k and v as separate parameters and the dense MLP gate and up, so each is orthogonalised
on its own (Megatron's ``--muon-split-qkv``, its default); the experts' ``w13 [e, G, F, H]`` and ``w2 [e, H, F]`` are
batches of ``e * G`` and ``e`` matrices.

Sharding (layer-wise, as Megatron's): ``GradSync`` is built with ``whole=is_muon_matrix``, so the matrices sit in
flat groups laid out whole (``buffers._layout_whole``): each matrix lies in one rank's chunk of its reduction
group. The reduce-scatter leaves its complete gradient there, that rank alone keeps its momentum (and fp32 master for
bf16 parameters) and computes its step, and the usual parameter all-gather (``ParamSync``) spreads the result; no
communication beyond the AdamW optimizer's, except the tensor-parallel modes' (``--muon-tp-mode``). Optimizer state
per matrix element: one momentum (``--exp-avg-dtype``, Megatron's precision-aware option) instead of AdamW's two.

Checkpoints: ``optim.<param>.momentum`` (and ``.master``) as ``ShardPieces`` of the whole local tensor on its owner,
so DCP reshards them like AdamW's moments (another dp, tp, ep, pp).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moefold.parallel.dims import ParallelDims
from moefold.parallel.sharding import shards_of
from moefold.training.optim.grad_sync import GradSync
from moefold.training.optim.newton_schulz import COEFFICIENTS, ScaleMode, TPMode, matrix_shard, orthogonalize
from moefold.training.optim.optimizer import DistributedAdamW, decays, norm_squared, replicas
from moefold.training.optim.precision import OptimizerPrecision
from moefold.training.optim.state_shards import ShardPieces

MATMUL_PRECISIONS = ("highest", "high", "medium")   # medium: the iteration in bf16 (Megatron's default)
_ADAMW_ONLY = ("embed_tokens", "output_head", "router")


def is_muon_matrix(name: str, param: Tensor) -> bool:
    """Whether Muon updates ``param``: a 2-D weight, or an expert weight ``[e, ..., rows, cols]`` (each expert's
    matrices on their own); never embeddings, the output layer, routers, biases, norms or convolution kernels."""
    parts = name.lower().split(".")
    if any(p in _ADAMW_ONLY for p in parts) or parts[-1] == "bias" or parts[-1].endswith("_bias"):
        return False
    if getattr(param, "moefold_expert", False):
        return param.dim() >= 3
    return param.dim() == 2


@dataclass(frozen=True)
class MuonOptions:
    """Megatron's ``--muon-*`` settings (its names and defaults); validated here, once."""

    momentum: float = 0.95
    use_nesterov: bool = False
    num_ns_steps: int = 5
    coefficient_type: str = "quintic"
    scale_mode: ScaleMode = ScaleMode.SPECTRAL
    extra_scale_factor: float = 1.0
    tp_mode: TPMode = TPMode.BLOCKWISE
    fp32_matmul_prec: str = "medium"

    def __post_init__(self) -> None:
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--muon-momentum={self.momentum} must lie in [0, 1)")
        if not isinstance(self.num_ns_steps, int) or self.num_ns_steps < 1:
            raise ValueError(f"--muon-num-ns-steps={self.num_ns_steps!r} must be a positive integer")
        if self.coefficient_type not in COEFFICIENTS:
            raise ValueError(f"--muon-coefficient-type={self.coefficient_type!r}; valid: {', '.join(COEFFICIENTS)}")
        if not self.extra_scale_factor > 0:
            raise ValueError(f"--muon-extra-scale-factor={self.extra_scale_factor} must be > 0")
        if self.fp32_matmul_prec not in MATMUL_PRECISIONS:
            raise ValueError(f"--muon-fp32-matmul-prec={self.fp32_matmul_prec!r}; valid: "
                             f"{', '.join(MATMUL_PRECISIONS)}")
        if not isinstance(self.scale_mode, ScaleMode) or not isinstance(self.tp_mode, TPMode):
            raise ValueError(f"scale_mode={self.scale_mode!r} and tp_mode={self.tp_mode!r} must be ScaleMode and "
                             "TPMode members")


class _Matrix:
    """One parameter this rank owns whole: its gradient view, momentum, and master (fp32 copy of bf16 values)."""

    def __init__(self, name: str, param: nn.Parameter, grad: Tensor, weight: float, decays: bool,
                 precision: OptimizerPrecision) -> None:
        self.name, self.param, self.grad, self.weight, self.decays = name, param, grad, weight, decays
        master_dtype = precision.dtype("main_params")
        self.separate_master = param.dtype != master_dtype
        flat = param.data.view(-1)
        self.master = torch.empty_like(flat, dtype=master_dtype).copy_(flat) if self.separate_master else flat
        self.momentum = torch.zeros_like(flat, dtype=precision.dtype("exp_avg"))
        self.shard = matrix_shard(shards_of(param), param.dim())

    def step(self, lr: float, clip_coef: float, wd: float, o: MuonOptions) -> None:
        grad = self.grad.float()
        if clip_coef != 1.0:
            grad = grad * clip_coef
        if self.decays and wd:
            self.master.mul_(1.0 - lr * wd)
        momentum = self.momentum.float()
        momentum.lerp_(grad, 1.0 - o.momentum)
        if self.momentum.dtype != torch.float32:
            self.momentum.copy_(momentum)
        update = grad.lerp(momentum, o.momentum) if o.use_nesterov else momentum
        shape = self.param.shape
        ortho = orthogonalize(update.view(shape), self.shard, o.tp_mode, o.num_ns_steps, o.coefficient_type,
                              o.scale_mode, bf16=o.fp32_matmul_prec == "medium")
        self.master.add_(ortho.reshape(-1), alpha=-lr * o.extra_scale_factor)
        if self.separate_master:
            self.param.data.view(-1).copy_(self.master)

    def state_tensors(self) -> dict[str, Tensor]:
        out = {"momentum": self.momentum}
        if self.separate_master:
            out["master"] = self.master
        return out


class DistributedMuon:
    """Muon on the matrices this rank owns whole, ``DistributedAdamW`` on every other parameter's chunks; the
    interface the trainer uses of ``DistributedAdamW`` (module docstring). Collective: ``grad_norm()``, ``step()``
    (AdamW's gathers, the tp modes' collectives), ``loaded()``."""

    def __init__(self, sync: GradSync, dims: ParallelDims, *, options: MuonOptions = MuonOptions(),
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 precision: OptimizerPrecision | None = None, decay_fn: Callable[[str, Tensor], bool] = decays,
                 model: nn.Module | None = None, overlap_param_gather: bool = False) -> None:
        if not any(g.whole for g in sync.groups) and sync.groups:
            raise ValueError("DistributedMuon needs a GradSync built with whole=is_muon_matrix (its matrices laid out "
                             "whole); this one has none")
        precision = precision or OptimizerPrecision()
        self.options, self.weight_decay = options, weight_decay
        self.adam = DistributedAdamW(sync, dims, betas=betas, eps=eps, weight_decay=weight_decay, precision=precision,
                                     decay_fn=decay_fn, model=model, overlap_param_gather=overlap_param_gather,
                                     whole_update=self._update)
        self.matrices: list[_Matrix] = []
        for g in sync.groups:
            if not g.whole:
                continue
            for b in g.buckets:
                for i, lo, hi in g.pieces(b):
                    p, off = g.params[i], g.offsets[i]
                    assert (lo, hi) == (0, p.numel()), "a whole group's parameter lies in one chunk"
                    self.matrices.append(_Matrix(g.names[i], p, g.grad_data[off:off + hi],
                                                 1.0 / replicas(p, g.size, dims), decay_fn(g.names[i], p), precision))
        self._owned = {id(m.param): m for m in self.matrices}
        device = sync.groups[0].grad_data.device if sync.groups else torch.device("cpu")
        self._norm_grads = [m.grad for m in self.matrices]
        self._norm_weights = torch.tensor([m.weight for m in self.matrices], dtype=torch.float32, device=device)
        self._device = device

    @property
    def step_count(self) -> int:
        return self.adam.step_count

    @property
    def param_sync(self):
        return self.adam.param_sync

    def _update(self, lr: float, clip_coef: float) -> None:
        for m in self.matrices:
            m.step(lr, clip_coef, self.weight_decay, self.options)

    # ------------------------------------------------------------------------------- the step
    def grad_norm(self) -> Tensor:
        """Global L2 norm of the step's gradient, Muon's matrices and AdamW's chunks together (identical on every
        rank). Collective."""
        return self.adam.grad_norm(norm_squared(self._norm_grads, self._norm_weights, self._device))

    @torch.no_grad()
    def step(self, lr: float, clip_coef: float = 1.0) -> None:
        """AdamW on its chunks, Muon on this rank's matrices, then the parameter all-gathers."""
        self.adam.step(lr, clip_coef)

    def finish_param_sync(self) -> None:
        self.adam.finish_param_sync()

    def close(self) -> None:
        self.adam.close()

    @torch.no_grad()
    def scale_rows(self, param: nn.Parameter, factors: Tensor) -> None:
        """``param[i] *= factors[i]`` for each row i of its local tensor (after the step's gathers: QK-clip,
        ``training.optim.qk_clip``), and of its fp32 master where this rank owns a bf16 matrix. Every rank that holds
        ``param`` calls it with the same factors."""
        shape = (-1, *[1] * (param.dim() - 1))
        param.data.mul_(factors.view(shape).to(param.dtype))
        owned = self._owned.get(id(param))
        if owned is not None and owned.separate_master:
            owned.master.view(param.shape).mul_(factors.view(shape).to(owned.master.dtype))

    # ------------------------------------------------------------------------------- memory
    def state_breakdown(self, offloaded: bool = False) -> dict[str, int]:
        """AdamW's {"master", "exp_avg", "exp_avg_sq"} bytes, Muon's momentum counted as ``exp_avg``."""
        out = self.adam.state_breakdown(offloaded)
        if not offloaded:
            for m in self.matrices:
                out["exp_avg"] += m.momentum.nbytes
                out["master"] += m.master.nbytes if m.separate_master else 0
        return out

    def state_bytes(self) -> int:
        return sum(self.state_breakdown().values())

    def host_bytes(self) -> int:
        return self.adam.host_bytes()

    # ------------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self, keys: set[str] | None = None) -> dict[str, ShardPieces]:
        """AdamW's entries and ``optim.<param>.momentum`` / ``.master`` of the matrices this rank owns (views)."""
        out = self.adam.checkpoint_state(keys)
        for m in self.matrices:
            for key, t in m.state_tensors().items():
                fqn = f"optim.{m.name}.{key}"
                if keys is None or fqn in keys:
                    out[fqn] = ShardPieces.of_flat_range(m.param, 0, m.param.numel(), t)
        return out

    def master_fallback(self, keys: set[str]) -> dict[str, ShardPieces]:
        """As ``DistributedAdamW.master_fallback``, for both parts."""
        out = self.adam.master_fallback(keys)
        for m in self.matrices:
            master = f"optim.{m.name}.master"
            if m.separate_master and master not in keys:
                out[f"model.{m.name}"] = ShardPieces.of_flat_range(m.param, 0, m.param.numel(), m.master)
            elif not m.separate_master and master in keys:
                out[master] = ShardPieces.of_flat_range(m.param, 0, m.param.numel(), m.master)
        return out

    @torch.no_grad()
    def loaded(self, step_count: int) -> None:
        """After loading: the parameters become the (cast) masters, then AdamW's ``loaded`` gathers. Collective."""
        for m in self.matrices:
            if m.separate_master:
                m.param.data.view(-1).copy_(m.master)
        self.adam.loaded(step_count)
