"""``--compile``: ``torch.compile`` per transformer block (TorchTitan's approach), MoE-aware.

    report = compile_model(model, log=print)    # in place: parameter names and checkpoints unchanged

The execution pass (``execution.apply``) runs it after every region and GEMM is installed (the compiled graphs trace
the regions in force) and before FSDP2 (whose hooks must not be traced into the blocks).

- A dense block is compiled whole (``nn.Module.compile``: in place, so ``state_dict`` keys do not
  gain ``_orig_mod.``); identical blocks share their compiled graphs (parameters are graph inputs).
- An MoE block is compiled child by child, as TorchTitan does: the norms, the attention, the
  router and the shared experts each; the routed experts' elementwise region (SwiGLU / GELU)
  runs as one compiled kernel per direction with the row count as a symbolic size
  (``moe.activation.fused_activation``, ``dynamic=True``). The token dispatch and combine stay eager:
  their shapes depend on the routing (data-dependent row counts, host split sizes) and they call
  collectives; the grouped GEMMs are library kernels either way.
- Collectives inside a compiled module (tensor-parallel regions) graph-break: those autograd
  functions run eagerly between compiled pieces, so every layout compiles.

Backends: inductor's C++ code generation on CPU (needs a C++ compiler: ``$CXX`` or ``g++``) and
Triton on CUDA. ``compile_unavailable(device)`` says why it cannot run, before any rank starts.
Compilation happens during the first forward and backward; the time spent is logged at the
second forward (``CompileReport``) and is available from ``report.seconds()``.
Compiled kernels are cached on disk by inductor (``TORCHINDUCTOR_CACHE_DIR``), so a second run compiles much
faster. On CPU the default cache is one folder per CPU kernel level (``cpu_kernel_cache_dir``): torch 2.13's cache
does not tell kernels built for one level (``ATEN_CPU_CAPABILITY``, AMX or not) from another's, and reusing them
across levels gave NaNs and heap corruption (``malloc(): unaligned tcache chunk``) in moefold's tests.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable, Iterator

import torch
from torch import nn

from moefold.dense.block import TransformerBlock
from moefold.moe.activation import COMPILED_ACTIVATION
from moefold.moe.layer import MoELayer


def compile_unavailable(device: torch.device | str) -> str | None:
    """Why ``torch.compile`` cannot generate code for ``device`` here, or None when it can."""
    kind = torch.device(device).type
    if kind == "cpu":
        cxx = os.environ.get("CXX", "g++")
        if shutil.which(cxx) is None:
            return (f"--compile on CPU needs a C++ compiler for inductor's generated kernels: {cxx!r} is not on "
                    f"PATH (install g++, or set CXX)")
        return None
    if kind == "cuda" and importlib.util.find_spec("triton") is None:
        return "--compile on CUDA needs Triton (pip install triton; PyTorch's CUDA wheels include it)"
    return None


def cpu_kernel_cache_dir() -> str:
    """Inductor's cache folder for this process's CPU kernel level: its default folder plus ``cpu-<level>[-amx]``
    (``torch.backends.cpu.get_cpu_capability()``, which follows ``ATEN_CPU_CAPABILITY``)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    level = torch.backends.cpu.get_cpu_capability().lower()
    amx = "-amx" if level.startswith("avx512") and torch.cpu._is_amx_tile_supported() else ""
    return os.path.join(default_cache_dir(), f"cpu-{level}{amx}")


def use_cpu_kernel_cache() -> None:
    """Point inductor at ``cpu_kernel_cache_dir()`` unless ``TORCHINDUCTOR_CACHE_DIR`` names another folder than
    inductor's default (inductor writes its default into the variable when it first resolves it, so that value
    is not a choice of the user's). Call before the process's first compile."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cpu_kernel_cache_dir()


def transformer_blocks(model: nn.Module) -> Iterator[TransformerBlock]:
    """Every transformer block of a decoder or pipeline stage (``layers`` and the MTP modules' blocks)."""
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            yield module


def compile_moe_layer(moe: MoELayer) -> int:
    """Compile an MoE layer's static-shaped pieces in place (router, shared experts, the routed experts'
    activation); the dispatch, combine and grouped GEMMs stay eager. Returns how many were compiled."""
    moe.router.compile()
    compiled = 1
    if moe.shared_experts is not None:
        moe.shared_experts.compile()
        compiled += 1
    moe.experts.configure(activation_kernel=COMPILED_ACTIVATION)
    return compiled


def _compile_seconds() -> dict[str, float]:
    from torch._dynamo.utils import compile_times

    names, times = compile_times(repr="csv", aggregate=True)
    return {name: float(t) for name, t in zip(names, times)}


class CompileReport:
    """What ``compile_model`` compiled, and how long compiling took.

    Dynamo compiles each piece at its first forward, with the backward graph, except backward
    graphs that AOTAutograd compiles lazily at the first backward: the compile time is dynamo's
    total plus those lazy backward compiles. It is logged once, at the model's second forward
    (after the first forward + backward), timed at the first transformer block; ``seconds()`` reads it
    at any time.
    """

    _DYNAMO, _BACKWARD = "_compile.compile_inner", "compile_fx.<locals>.bw_compiler"

    def __init__(self, blocks: int, modules: int, log: Callable[[str], None]) -> None:
        self.blocks, self.modules, self.log = blocks, modules, log
        self.forwards, self._backward_in_forward = 0, 0.0
        self.handles: list = []

    def seconds(self) -> float:
        """Seconds spent compiling in this process so far (dynamo + inductor, backward graphs included)."""
        t = _compile_seconds()
        lazy_backward = t.get(self._BACKWARD, 0.0) - self._backward_in_forward
        return t.get(self._DYNAMO, 0.0) + (lazy_backward if self.forwards else 0.0)

    def _after_forward(self, module: nn.Module, args: object, output: object) -> None:
        if self.forwards == 0:  # backward compiles so far ran inside dynamo's (counted there)
            self._backward_in_forward = _compile_seconds().get(self._BACKWARD, 0.0)
        self.forwards += 1

    def _before_forward(self, module: nn.Module, args: object) -> None:
        if self.forwards == 1:
            self.log(f"torch.compile: {self.blocks} transformer blocks ({self.modules} modules) compiled in "
                     f"{self.seconds():.1f} s (first forward + backward)")
            for handle in self.handles:
                handle.remove()


def compile_model(model: nn.Module, log: Callable[[str], None] = print) -> CompileReport:
    """Compile ``model``'s transformer blocks in place (see the module docstring); returns the report."""
    if any(p.device.type == "cpu" for p in model.parameters()):
        use_cpu_kernel_cache()
    blocks = modules = 0
    first = None
    for block in transformer_blocks(model):
        first = first or block
        blocks += 1
        if isinstance(block.mlp, MoELayer):
            for child in (block.input_layernorm, block.self_attn, block.post_attention_layernorm):
                child.compile()
                modules += 1
            modules += compile_moe_layer(block.mlp)
        else:
            block.compile()
            modules += 1
    report = CompileReport(blocks, modules, log)
    if first is not None:  # the first block runs in every path (whole model, pipeline stage, MTP)
        report.handles = [first.register_forward_hook(report._after_forward),
                          first.register_forward_pre_hook(report._before_forward)]
    return report


__all__ = ["CompileReport", "compile_model", "compile_moe_layer", "compile_unavailable", "cpu_kernel_cache_dir",
           "transformer_blocks", "use_cpu_kernel_cache"]
