"""The dtypes of the optimizer's tensors, with Megatron's flag names (a leaf module: the CLI validates with it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# the flags' dtype names -> torch's (torch is imported when the optimizer asks for a dtype, not to check the flags)
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class OptimizerPrecision:
    """Dtypes of the optimizer's tensors (Megatron: ``--main-grads-dtype``, ``--main-params-dtype``,
    ``--exp-avg-dtype``, ``--exp-avg-sq-dtype``). ``main_params_dtype`` is the master copy kept for
    parameters of another dtype (bf16 models); fp32 parameters are their own master."""

    main_grads_dtype: str = "fp32"
    main_params_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)!r}; valid: {', '.join(DTYPES)}")
        if self.main_params_dtype != "fp32":
            raise ValueError(f"--main-params-dtype={self.main_params_dtype!r}; valid: fp32 (the master copy of "
                             "bf16 parameters)")

    def dtype(self, name: str) -> torch.dtype:
        import torch

        return getattr(torch, DTYPES[getattr(self, f"{name}_dtype")])
