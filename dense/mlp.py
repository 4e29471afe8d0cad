"""The dense feed-forward block: SwiGLU (or GELU), column-parallel in, row-parallel out.

Parameter names follow HF (``gate_proj``, ``up_proj``, ``down_proj``; GELU has no gate), each a
separate weight so checkpoints map one to one. Crosses ranks: one sequence all-gather (SP) or
region entry shared by gate and up, and one reduce-scatter (SP) or all-reduce after down.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moefold.dense.linear import ColumnParallelLinear, RowParallelLinear, on_tp_input
from moefold.parallel.groups import Group, group_size


class Activation(StrEnum):
    """The MLP's activation (its values: the configs' words, kept in YAML, JSON and checkpoints)."""

    SWIGLU = "swiglu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    RELU2 = "relu2"


MLP_ACTIVATIONS: tuple[str, ...] = tuple(a.value for a in Activation)


@dataclass(frozen=True)
class MLPConfig:
    """``activation``: "swiglu" (``down(silu(gate(x)) * up(x))``, HF LlamaMLP), "gelu" or "gelu_tanh"
    (``down(gelu(up(x)))``, exact or tanh-approximated), "relu2" (``down(relu(up(x))^2)``, Nemotron-H). ``bias``:
    biases on every projection."""

    hidden_size: int
    ffn_hidden_size: int
    activation: Activation = Activation.SWIGLU
    bias: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("hidden_size", "ffn_hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MLPConfig.{name}={value!r} must be a positive integer")
        if self.activation not in MLP_ACTIVATIONS:
            raise ValueError(f"MLPConfig.activation={self.activation!r} is not one of {MLP_ACTIVATIONS}")
        object.__setattr__(self, "activation", Activation(self.activation))
        if not self.init_std > 0:
            raise ValueError(f"MLPConfig.init_std={self.init_std!r} must be > 0")

    def check_parallel(self, tp: int) -> None:
        if self.ffn_hidden_size % tp != 0:
            raise ValueError(f"MLPConfig: ffn_hidden_size={self.ffn_hidden_size} is not divisible by tp={tp}")


class DenseMLP(nn.Module):
    """forward(x [S, B, H], or with ``sequence_parallel`` [S/tp, B, H]) -> same shape.

    Local weights: gate/up ``[F/tp, H]`` (Shard dim 0), down ``[H, F/tp]`` (Shard dim 1).
    """

    def __init__(self, config: MLPConfig, tp_group: Group = None, *, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        config.check_parallel(group_size(tp_group))
        self.config, self.tp_group, self.sequence_parallel = config, tp_group, sequence_parallel
        c = config
        kw = {"bias": c.bias, "init_std": c.init_std, "dtype": dtype, "device": device}
        if c.activation is Activation.SWIGLU:
            self.gate_proj = ColumnParallelLinear(c.hidden_size, c.ffn_hidden_size, tp_group, **kw)
        else:
            self.gate_proj = None
        self.up_proj = ColumnParallelLinear(c.hidden_size, c.ffn_hidden_size, tp_group, **kw)
        self.down_proj = RowParallelLinear(c.ffn_hidden_size, c.hidden_size, tp_group,
                                           sequence_parallel=sequence_parallel, **kw)
        self._gelu_approximate = "tanh" if c.activation is Activation.GELU_TANH else "none"  # F.gelu's argument

    def forward(self, x: Tensor) -> Tensor:
        # one all-gather (SP) / region entry feeds both gate and up (SP: both keep the shard, dense.linear.on_tp_input)
        up, gate = on_tp_input(x, self.tp_group, self.sequence_parallel, self._gate_up)
        if gate is not None:
            h = F.silu(gate) * up
        elif self.config.activation is Activation.RELU2:
            h = torch.square(F.relu(up))
        else:
            h = F.gelu(up, approximate=self._gelu_approximate)
        return self.down_proj(h)

    def _gate_up(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        return self.up_proj.forward_local(x), None if self.gate_proj is None else self.gate_proj.forward_local(x)

    def extra_repr(self) -> str:
        return f"activation={self.config.activation.value}, tp={group_size(self.tp_group)}, sp={self.sequence_parallel}"
