"""Shared experts: a SwiGLU (or squared-ReLU, Nemotron-H) MLP every token goes through, optionally scaled by a
sigmoid gate.

``y_shared = MLP(x)`` (DeepSeek) or ``sigmoid(x @ w_gate^T) * MLP(x)`` (Qwen2-MoE
``shared_expert_gate``). Under attention tensor parallelism it is split exactly like the dense
MLP (column-parallel gate/up, row-parallel down, over ``tp_group``), which is both correct and
the cheapest choice: with sequence parallelism its input is the ``[S/tp, B, H]`` shard and its
output comes back as that shard. The MoE layer runs it while the token dispatch is in flight.

Weights (HF names): ``gate_proj`` and ``up_proj`` column-parallel ``[Fs/tp, H]`` (two layers, not
one fused ``[2Fs/tp, H]``, so that each tp shard holds matching gate and up rows and HF weights
load unchanged), ``down_proj`` row-parallel ``[H, Fs/tp]``; ``gate [1, H]`` replicated (its
gradient is partial under SP, hence ``mark_sequence_parallel``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moefold.dense.linear import ColumnParallelLinear, RowParallelLinear, on_tp_input
from moefold.moe.activation import ExpertActivation
from moefold.parallel.groups import Group
from moefold.parallel.sharding import mark_sequence_parallel, normal_init, set_init


class SharedExperts(nn.Module):
    """forward(x [S, B, H]) -> [S, B, H], same sharding as the input (SP shard or replicated over tp)."""

    def __init__(self, hidden_size: int, ffn_size: int, *, tp_group: Group = None, sequence_parallel: bool = False,
                 gate: bool = False, init_std: float = 0.02, output_init_std: float | None = None,
                 clamp: float | None = None,
                 activation: ExpertActivation = ExpertActivation.SWIGLU, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.clamp = clamp   # DeepSeek-V4's swiglu_limit on the gate and up projections (None: unclamped)
        kw = {"tp_group": tp_group, "sequence_parallel": sequence_parallel, "dtype": dtype, "device": device}
        # relu2: Nemotron-H's ungated ``down(relu(up(x))^2)``, no gate_proj
        relu2 = ExpertActivation(activation) is ExpertActivation.RELU2
        self.gate_proj = None if relu2 else ColumnParallelLinear(hidden_size, ffn_size, init_std=init_std, **kw)
        self.up_proj = ColumnParallelLinear(hidden_size, ffn_size, init_std=init_std, **kw)
        self.down_proj = RowParallelLinear(ffn_size, hidden_size, init_std=output_init_std or init_std, **kw)
        if gate:
            self.gate = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device))
            set_init(self.gate, normal_init(init_std))
            with torch.no_grad():
                self.gate.normal_(0.0, init_std)
            if sequence_parallel:
                mark_sequence_parallel(self.gate)
        else:
            self.register_parameter("gate", None)

    def forward(self, x_SBH: Tensor) -> Tensor:
        # one all-gather (SP) / region entry feeds gate and up (two layers keep the weights in HF's shape); under
        # SP both keep the shard for their weight gradients, not the gathered sequence (dense.linear.on_tp_input)
        up, gate = on_tp_input(x_SBH, self.up_proj.tp_group, self.up_proj.sequence_parallel, self._gate_up)
        if gate is None:
            y = self.down_proj(torch.square(F.relu(up)))
        else:
            if self.clamp is not None:   # elementwise, so each tp shard clamps its own columns as world 1 does
                gate, up = gate.clamp(max=self.clamp), up.clamp(-self.clamp, self.clamp)
            y = self.down_proj(F.silu(gate) * up)
        if self.gate is not None:
            y = torch.sigmoid(F.linear(x_SBH, self.gate)) * y
        return y

    def _gate_up(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        return self.up_proj.forward_local(x), None if self.gate_proj is None else self.gate_proj.forward_local(x)
