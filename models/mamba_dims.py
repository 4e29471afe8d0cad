"""Mamba-2 sizes of a hybrid model's ``mamba`` layers (Nemotron-H), torch-free: ``MambaDims``.

``ModelHybrid.mamba`` holds them; ``models.layer_factory`` hands them to ``dense.mamba2.Mamba2Config`` with the
model's width and norm eps. Names follow HF ``NemotronHConfig`` (``mamba_num_heads``, ``mamba_head_dim``,
``ssm_state_size``, ``n_groups``, ``conv_kernel``, ``use_conv_bias``, ``mamba_proj_bias``, ``chunk_size``,
``time_step_limit``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MambaDims:
    """One Mamba-2 mixer's sizes (defaults: Nemotron 3 Nano 30B-A3B's)."""

    num_heads: int = 64
    head_dim: int = 64
    state_size: int = 128
    num_groups: int = 8
    conv_kernel: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    chunk_size: int = 128
    # the clamp of dt: (low, high), high None for none (JSON has no infinity: run configs and checkpoints stay JSON)
    time_step_limit: tuple[float, float | None] = (0.0, None)

    def __post_init__(self) -> None:
        if isinstance(self.time_step_limit, list):   # a JSON round trip hands back a list
            object.__setattr__(self, "time_step_limit", tuple(self.time_step_limit))
        if len(self.time_step_limit) == 2 and self.time_step_limit[1] == float("inf"):
            object.__setattr__(self, "time_step_limit", (self.time_step_limit[0], None))
        for name in ("num_heads", "head_dim", "state_size", "num_groups", "conv_kernel", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"mamba.{name}={value!r} must be a positive integer")
        if self.num_heads % self.num_groups:
            raise ValueError(f"mamba.num_heads={self.num_heads} is not a multiple of mamba.num_groups="
                             f"{self.num_groups}")
        low, high = self.time_step_limit
        if not 0.0 <= low <= (float("inf") if high is None else high):
            raise ValueError(f"mamba.time_step_limit={self.time_step_limit!r} must be (low, high), 0 <= low <= high")

    @property
    def inner_size(self) -> int:
        """Width of the mixer's SSM input and output (``heads * head_dim``)."""
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the causal convolution: x, B and C (``inner + 2 groups state``)."""
        return self.inner_size + 2 * self.num_groups * self.state_size
