"""FP8 training settings (Megatron's ``--fp8-format`` / ``--fp8-recipe``, plus ``--fp8-backend``), in one place.

``FP8Config`` is what a run asks for; its flags are defined once, in ``training.cli.fp8_flags`` (their
choices are this module's tuples), so a new backend or recipe is added here once.

- format ``e4m3``: E4M3 everywhere; ``hybrid``: E4M3 forward, E5M2 gradients.
- backend ``torchao`` (default): torchao's float8 training recipes run by moefold's own scaled-GEMM
  autograd functions (``precision.fp8_cast``) in every column/row-parallel linear (``execution.fp8_linear``)
  and in the grouped expert GEMMs (``moe.fp8_gemm``), on CPU (torch's emulated ``_scaled_mm``) and
  CUDA. Recipes: ``tensorwise`` (one scale per tensor; per expert for the experts) and ``rowwise``
  (one scale per row along each GEMM's contraction dim, power-of-2 scales).
  Block-scaled recipes (``precision.block_cast``, run by ``precision.block_linear`` / ``moe.block_gemm``):
  ``blockwise`` (DeepSeek-V3's: activations and gradients per 1x128 tile along each GEMM's contraction dim,
  weights per 128x128 block, fp32 scales; torchao's ``blockwise_fp8_training``), ``mxfp8`` (32-element
  blocks with e8m0 scales, RCEIL; torchao's ``mx_formats`` / ``moe_training``), and FP4 ``nvfp4``
  (``--fp4-format e2m1``: e2m1 values, 16-element blocks with e4m3 scales under an fp32 per-tensor scale,
  weights in 16x16 blocks). On CPU they are emulated (quantise, dequantise, fp32 GEMM: the numerics, no
  speed-up).
- backend ``te``: Transformer Engine's autocast around TE modules: the linears through ``te.Linear``
  and the experts through ``te.GroupedLinear`` (``--moe-grouped-gemm-backend te``). Recipes:
  ``delayed`` (amax history, TE ``DelayedScaling``), ``tensorwise`` (``Float8CurrentScaling``),
  ``blockwise`` (``Float8BlockScaling``: 1x128 / 128x128, compute capability 9.0+ and CUDA 12.9+),
  ``mxfp8`` (32-element blocks, ``MXFP8BlockScaling``; compute capability 10.x), and ``nvfp4``
  (``--fp4-format e2m1``: ``NVFP4BlockScaling``, compute capability 10.0+). TE's autocast is entered
  once per stage forward with the stage's dp x cp x tp group as its amax group (``precision.fp8_region``);
  its amax history is not checkpointed: a resumed run rebuilds it over its first steps.

The weights stay what they are (fp32 or bf16 parameters, fp32 master weights): only the GEMMs'
operands are cast, so checkpoints, resharding and HF export are the same with and without FP8.
Modules whose qualified name contains one of ``exclude_modules`` (default: the output head) keep
their GEMMs in high precision; the router never runs in FP8 (its GEMM is fp32, ``--moe-router-dtype``).

``dispatch`` (``--moe-fp8-dispatch``, independent of the format) sends the routed tokens to their
experts as E4M3 with per-128-channel scales (``dispatch.fp8_exchange``).
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # torch is imported where a check needs a device, so that a config is read without it (CLI)
    import torch


class FP8Format(StrEnum):
    """``--fp8-format``: E4M3 everywhere, or E4M3 forward and E5M2 gradients (``hybrid``)."""

    E4M3 = "e4m3"
    HYBRID = "hybrid"

    @classmethod
    def _missing_(cls, value: object) -> FP8Format:
        raise ValueError(f"--fp8-format={value!r} is not one of {', '.join(cls)}")


class FP8Recipe(StrEnum):
    """``--fp8-recipe`` (and FP4's one recipe, ``nvfp4``): how the operands are scaled (module docstring)."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    DELAYED = "delayed"
    BLOCKWISE = "blockwise"
    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"

    @classmethod
    def _missing_(cls, value: object) -> FP8Recipe:
        raise ValueError(f"--fp8-recipe={value!r} is not one of {', '.join(FP8_RECIPES)}")


class FP8Backend(StrEnum):
    """``--fp8-backend``: torchao's recipes run by moefold's own GEMMs, or Transformer Engine's modules."""

    TORCHAO = "torchao"
    TE = "te"

    @classmethod
    def _missing_(cls, value: object) -> FP8Backend:
        raise ValueError(f"--fp8-backend={value!r} is not one of {', '.join(cls)}")


FP8_FORMATS: tuple[str, ...] = tuple(FP8Format)
FP4_FORMATS: tuple[str, ...] = ("e2m1", "nvfp4")   # Megatron's --fp4-format e2m1; nvfp4 names the same thing
FP4_RECIPES: tuple[FP8Recipe, ...] = (FP8Recipe.NVFP4,)
FP8_BACKENDS: tuple[str, ...] = tuple(FP8Backend)
# the FP8 recipes each backend runs; the first is its default (FP4: nvfp4 on both)
BACKEND_RECIPES: dict[FP8Backend, tuple[FP8Recipe, ...]] = {
    FP8Backend.TORCHAO: (FP8Recipe.TENSORWISE, FP8Recipe.ROWWISE, FP8Recipe.BLOCKWISE, FP8Recipe.MXFP8),
    FP8Backend.TE: (FP8Recipe.DELAYED, FP8Recipe.TENSORWISE, FP8Recipe.BLOCKWISE, FP8Recipe.MXFP8)}
FP8_RECIPES: tuple[FP8Recipe, ...] = tuple(r for r in FP8Recipe if r is not FP8Recipe.NVFP4)
BLOCK_RECIPES: tuple[FP8Recipe, ...] = (FP8Recipe.BLOCKWISE, FP8Recipe.MXFP8, FP8Recipe.NVFP4)   # precision.block_cast
# compute capability the GPU kernels of a recipe need (CPU: emulated); TE's own checks in quantization.py
MIN_CAPABILITY: dict[str, tuple[tuple[int, int], str]] = {
    "tensorwise": ((8, 9), "Ada/Hopper"), "rowwise": ((8, 9), "Ada/Hopper"), "delayed": ((8, 9), "Ada/Hopper"),
    "blockwise": ((9, 0), "Hopper"), "mxfp8": ((10, 0), "Blackwell"), "nvfp4": ((10, 0), "Blackwell")}
DEFAULT_EXCLUDE: tuple[str, ...] = ("output_head",)
TE_INSTALL = "pip install --no-build-isolation transformer-engine[pytorch] (needs CUDA)"
TORCHAO_INSTALL = 'pip install torchao==0.18.0 (or pip install -e ".[fp8]")'


def _flag(default: object, flag: str, help: str, **meta: object) -> object:
    # a field that is a flag of ``moefold train`` (the metadata ``models.flag_field.flag`` writes, without importing
    # models/ from below it): training.cli.fp8_flags makes the flag from it (name, help, default, choices)
    return field(default=default, metadata={"flag": flag, "help": help, **meta})


@dataclass(frozen=True)
class FP8Config:
    """format: None (FP8 GEMMs off) or one of ``FP8_FORMATS``; recipe: one of the backend's
    ``BACKEND_RECIPES`` (None: its default, filled in when the format is set); backend: one of
    ``FP8_BACKENDS``; exclude_modules: name fragments of modules kept in high precision;
    dispatch: FP8 token dispatch (works with or without FP8 GEMMs). Each field is its flag of ``moefold train``
    (metadata: Megatron-LM's name where it has one, help, choices; ``training.cli.fp8_flags``); ``recipe`` also
    takes ``--fp4-recipe`` with ``--fp4-format``."""

    format: FP8Format | None = _flag(   # noqa: RUF009
        None, "--fp8-format", choices=FP8_FORMATS,
        help="FP8 GEMMs in the linears and the experts: e4m3, or hybrid (e4m3 forward, e5m2 gradients); default off")
    recipe: FP8Recipe | None = _flag(   # noqa: RUF009
        None, "--fp8-recipe", choices=FP8_RECIPES,
        help="FP8 scaling; torchao: tensorwise (default) | rowwise | blockwise (DeepSeek-V3: 1x128 activations, "
             "128x128 weights) | mxfp8 (32-element e8m0 blocks); te: delayed (default) | tensorwise | blockwise "
             "(Hopper) | mxfp8 (Blackwell). CPU: emulated")
    backend: FP8Backend = _flag(   # noqa: RUF009
        FP8Backend.TORCHAO, "--fp8-backend", choices=FP8_BACKENDS,
        help="torchao (default; CPU and CUDA) or te (Transformer Engine, CUDA; the experts need "
             "--moe-grouped-gemm-backend te)")
    exclude_modules: tuple[str, ...] = _flag(
        DEFAULT_EXCLUDE, "--fp8-exclude-modules", nargs="*", metavar="NAME",
        help="modules whose qualified name contains one of these keep high-precision GEMMs "
             f"(default: {' '.join(DEFAULT_EXCLUDE)}; e.g. add layers.0. for the first layer)")
    dispatch: bool = _flag(
        False, "--moe-fp8-dispatch", action="store_true",
        help="send routed tokens to their experts as e4m3 with per-128-channel scales (alltoall, allgather and flex "
             "on DeepEP V2)")
    fp4: str | None = _flag(   # e2m1: NVFP4 GEMMs instead of FP8 ones
        None, "--fp4-format", choices=FP4_FORMATS,
        help="FP4 GEMMs instead of FP8: e2m1 (NVFP4: 16-element blocks, e4m3 scales, an fp32 per-tensor scale; "
             "Blackwell, emulated on CPU); nvfp4 is the same")
    param_gather: bool = _flag(   # FP8 primary weights, all-gathered as FP8
        False, "--fp8-param-gather", action="store_true",
        help="FP8 primary weights: the distributed optimizer all-gathers the updated weights as FP8 (1 byte per "
             "element) from fp32 masters (torchao tensorwise or blockwise)")
    router_padding: bool = _flag(
        False, "--moe-router-padding-for-quantization", action="store_true",
        help="pad each expert's token count to the FP8/FP4 grouped GEMM's multiple (16, 32 MXFP8, 128 NVFP4 / "
             "torchao blockwise) in the dispatch's row map (zero rows, no extra copy)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "exclude_modules", tuple(self.exclude_modules))  # a list from JSON
        if self.format is not None:
            object.__setattr__(self, "format", FP8Format(self.format))
        if self.fp4 is not None and self.fp4 not in FP4_FORMATS:
            raise ValueError(f"--fp4-format={self.fp4!r} is not one of {', '.join(FP4_FORMATS)}")
        object.__setattr__(self, "backend", FP8Backend(self.backend))
        if self.fp4 is not None:
            if self.format is not None:
                raise ValueError(f"--fp4-format={self.fp4} and --fp8-format={self.format} cannot be used together; "
                                 "choose one")
            object.__setattr__(self, "fp4", "e2m1")
            if self.recipe not in (None, *FP4_RECIPES):
                raise ValueError(f"--fp4-format e2m1 runs recipe {', '.join(FP4_RECIPES)}, not {self.recipe!r}")
            object.__setattr__(self, "recipe", FP4_RECIPES[0])
        elif self.recipe is not None:
            recipe = FP8Recipe(self.recipe)
            if recipe not in FP8_RECIPES:
                raise ValueError(f"--fp8-recipe={self.recipe!r} is not one of {', '.join(FP8_RECIPES)}")
            object.__setattr__(self, "recipe", recipe)
        self._check_param_gather()
        if self.router_padding and not self.enabled:
            raise ValueError("--moe-router-padding-for-quantization pads expert token counts for FP8/FP4 GEMMs; "
                             "it needs --fp8-format or --fp4-format")
        if self.format is None:
            return
        valid = BACKEND_RECIPES[self.backend]
        if self.recipe is None:
            object.__setattr__(self, "recipe", valid[0])
        elif self.recipe not in valid:
            raise ValueError(f"--fp8-recipe={self.recipe} is not supported by --fp8-backend={self.backend}; "
                             f"it supports {', '.join(valid)}")
        if (self.backend is FP8Backend.TORCHAO and self.recipe in (FP8Recipe.BLOCKWISE, FP8Recipe.MXFP8)
                and self.format is FP8Format.HYBRID):
            kernels = "blockwise kernels" if self.recipe is FP8Recipe.BLOCKWISE else "MXFP8 training recipes"
            raise ValueError(f"--fp8-recipe {self.recipe} with --fp8-backend torchao is e4m3 everywhere (torchao's "
                             f"{kernels}): use --fp8-format e4m3, or --fp8-backend te for e5m2 gradients")

    def _check_param_gather(self) -> None:
        if not self.param_gather:
            return
        if self.format is None:
            raise ValueError("--fp8-param-gather keeps FP8 primary weights: it needs --fp8-format")
        if self.backend is not FP8Backend.TORCHAO or self.recipe not in (None, FP8Recipe.TENSORWISE,
                                                                          FP8Recipe.BLOCKWISE):
            raise ValueError(f"--fp8-param-gather needs one FP8 copy of each weight that serves both its forward and "
                             f"its backward GEMM: --fp8-backend torchao with --fp8-recipe tensorwise or blockwise "
                             f"(one scale per tensor / per 128x128 block), not {self.backend} {self.recipe}")

    @property
    def enabled(self) -> bool:
        """FP8 or FP4 GEMMs are on (``dispatch`` is separate)."""
        return self.format is not None or self.fp4 is not None

    @property
    def block_scaled(self) -> bool:
        """A block-scaled recipe run by moefold's own casts (``block_cast``): torchao blockwise/mxfp8/nvfp4."""
        return self.enabled and self.backend is FP8Backend.TORCHAO and self.recipe in BLOCK_RECIPES

    @property
    def align_size(self) -> int:
        """Rows each expert's token count is padded to with ``router_padding``: the grouped kernels' multiple
        (TE's ``get_align_size_for_quantization``: 32 MXFP8, 128 NVFP4, else 16; torchao's blockwise grouped GEMM
        pads its groups to 128)."""
        if self.recipe is FP8Recipe.MXFP8:
            return 32
        if self.recipe is FP8Recipe.NVFP4 or (self.recipe is FP8Recipe.BLOCKWISE
                                              and self.backend is FP8Backend.TORCHAO):
            return 128
        return 16

    @property
    def group_alignment(self) -> int:
        """Rows per expert block the FP8 grouped GEMMs want (1 with FP8 GEMMs off): 32 for MXFP8 (32-row scale
        blocks), else 16 (TE's ``Fp8Padding``; torch's ``_scaled_grouped_mm`` takes 16-row aligned groups). The
        flex dispatcher on DeepEP V2 lays its received rows out with this alignment (``expert_alignment``)."""
        if not self.enabled:
            return 1
        return 32 if self.recipe is FP8Recipe.MXFP8 else 16

    def describe(self) -> str:
        name = {FP8Backend.TORCHAO: "torchao", FP8Backend.TE: "Transformer Engine"}[self.backend]
        if not self.enabled:
            gemms = "fp8 off"
        elif self.fp4 is not None:
            gemms = f"fp4 {self.fp4} {self.recipe} ({name})"
        else:
            gemms = f"fp8 {self.format} {self.recipe} ({name})"
        extras = [x for x, on in (("fp8 param gather", self.param_gather), ("fp8 dispatch", self.dispatch),
                                  ("router padding", self.router_padding)) if on]
        return ", ".join([gemms, *extras])

    def te_recipe(self) -> Any:
        """Transformer Engine's recipe object for this config (imports transformer_engine), built once per
        (format, recipe): TE keys its amax buffers by the recipe and refuses to build recipes inside compiled
        regions (``quantization.py`` ``get_default_fp8_recipe``)."""
        return _te_recipe(self.format, self.recipe)

    def check_available(self) -> None:
        """Fail now, naming what is missing, if this config cannot run here (no-op when off)."""
        if not self.enabled:
            return
        if self.backend is FP8Backend.TORCHAO:
            import_torchao()
            import torch

            if torch.cuda.is_available():
                self.check_device(torch.device("cuda"))
            return
        import_te("transformer_engine.pytorch")
        self.te_recipe()
        # check_fp8_support() / check_mxfp8_support() / ... -> (ok, reason): in transformer_engine.pytorch.quantization
        # in recent releases, transformer_engine.pytorch.fp8 in older ones (2.8 and before); autocast asserts the same
        # (quantization.py autocast_enter)
        name = {FP8Recipe.MXFP8: "check_mxfp8_support", FP8Recipe.BLOCKWISE: "check_fp8_block_scaling_support",
                FP8Recipe.NVFP4: "check_nvfp4_support"}.get(self.recipe, "check_fp8_support")
        for module in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
            try:
                check = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                continue
            ok, reason = check()
            if not ok:
                raise RuntimeError(f"{self.flags()}: Transformer Engine says this device cannot run it: {reason}")
            return

    def flags(self) -> str:
        """The flags that chose this config, e.g. ``--fp8-format e4m3 --fp8-recipe blockwise``."""
        if self.fp4 is not None:
            return f"--fp4-format {self.fp4} --fp4-recipe {self.recipe}"
        return f"--fp8-format {self.format} --fp8-recipe {self.recipe}"

    def check_device(self, device: torch.device) -> None:
        """RuntimeError (one line) when ``device`` is a GPU without the tensor cores this recipe's kernels need
        (a CPU emulates every recipe: numerics, no speed-up)."""
        if not self.enabled or device.type != "cuda":
            return
        import torch

        need, arch = MIN_CAPABILITY[self.recipe]
        cap = torch.cuda.get_device_capability(device)
        if cap < need:
            raise RuntimeError(f"{self.flags()} needs compute capability {need[0]}.{need[1]}+ ({arch}); this GPU is "
                               f"{cap[0]}.{cap[1]}" + ("; --fp8-recipe blockwise runs on Hopper" if need[0] >= 10
                                                       and cap >= (9, 0) else ""))


_TORCHAO: list[Any] = []  # the imported torchao.float8, once imported


def import_torchao() -> Any:
    """``torchao.float8`` (ImportError naming the install command when torchao is missing).

    Cheap after the first call (the module is cached); every FP8 cast calls it.

    torchao's package import tries to load its compiled CUDA extensions and logs a warning for each
    one that does not match the installed torch (and torch logs a deprecation for an enum torchao
    registers); moefold uses none of those (only the pure-Python float8 recipes and scaling
    functions), so warnings are silenced for the import.
    """
    if _TORCHAO:
        return _TORCHAO[0]
    logs = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        _TORCHAO.append(importlib.import_module("torchao.float8"))
        return _TORCHAO[0]
    except ImportError as err:
        raise ImportError(f"--fp8-backend torchao needs the torchao package, which is not installed: "
                          f"{TORCHAO_INSTALL}") from err
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


@functools.cache
def _te_recipe(fmt: FP8Format | None, recipe: FP8Recipe | None) -> Any:
    recipe_mod = import_te("transformer_engine.common.recipe")
    fp8_format = recipe_mod.Format.E4M3 if fmt is FP8Format.E4M3 else recipe_mod.Format.HYBRID
    if recipe is FP8Recipe.DELAYED:
        return recipe_mod.DelayedScaling(fp8_format=fp8_format)
    if recipe is FP8Recipe.TENSORWISE:
        return recipe_mod.Float8CurrentScaling(fp8_format=fp8_format)
    if recipe is FP8Recipe.BLOCKWISE:   # 1x128 activations and gradients, 128x128 weights (TE's defaults)
        return recipe_mod.Float8BlockScaling(fp8_format=fp8_format)
    if recipe is FP8Recipe.NVFP4:   # TE's defaults: 2D weights, RHT and stochastic rounding on the backward operands
        return recipe_mod.NVFP4BlockScaling()
    return recipe_mod.MXFP8BlockScaling(fp8_format=fp8_format)


def import_te(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"--fp8-backend te runs through Transformer Engine, which is not installed: "
                          f"{TE_INSTALL}") from err


__all__ = ["BACKEND_RECIPES", "BLOCK_RECIPES", "FP4_FORMATS", "FP8_BACKENDS", "FP8_FORMATS", "FP8_RECIPES", "FP8Config",
           "import_te", "import_torchao"]
