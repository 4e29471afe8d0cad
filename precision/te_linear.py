"""The Transformer Engine GEMM of a column/row-parallel linear (``--fp8-backend te``).

``execution.fp8_linear.convert_linears_to_fp8`` installs a ``TELinearGemm`` as a linear's ``local_gemm``: a
persistent ``te.Linear`` (built on the meta device, no weights of its own) run on the layer's weight through
``torch.func.functional_call``, as ``moe.te_gemm`` does for the experts, inside the TE autocast region the
model entered for the whole stage forward (``precision.fp8_region``: one region, one amax group, not one per
call). Nothing crosses ranks here beyond what TE's autocast reduces (the amax over that region's group).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moefold.precision.fp8 import FP8Config, import_te
from moefold.precision.fp8_region import require_region


class TELinearGemm:
    """``(x, w [N, K], b) -> y`` through one persistent ``te.Linear``, inside the model's TE autocast region.

    Not an ``nn.Module`` on purpose: TE's module holds meta placeholders and must stay out of the
    layer's parameters and state_dict; the layer's weight is substituted on every call. Kept out of
    ``torch.compile``'s graphs (``--compile`` compiles whole dense blocks): TE's module forwards are
    dynamo-disabled anyway (``@no_torch_dynamo`` in ``module/linear.py``), and its ``DelayedScaling``
    refuses to enter an autocast while compiling (``quantization.py`` ``check_recipe_support``).
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, config: FP8Config) -> None:
        te = import_te("transformer_engine.pytorch")
        self.config = config
        self.module = te.Linear(in_features, out_features, bias=False, params_dtype=dtype, device="meta")

    @torch.compiler.disable
    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        require_region(self.config, "TELinearGemm")
        lead = x.shape[:-1]
        y = torch.func.functional_call(self.module, {"weight": w}, (x.reshape(-1, x.shape[-1]),))
        y = y.view(*lead, w.shape[0])
        return y if b is None else y + b

    def describe(self) -> str:
        return f"Transformer Engine {self.config.fp4 or self.config.format} {self.config.recipe}"


__all__ = ["TELinearGemm"]
