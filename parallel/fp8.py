"""FP8 training settings (Megatron's ``--fp8-format`` / ``--fp8-recipe``, plus ``--fp8-backend``), in one place.

``FP8Config`` is what a run asks for; ``add_fp8_arguments`` / ``fp8_config_from_args`` are the
only definitions of its flags, so a new backend or recipe is added here once.

- format ``e4m3``: E4M3 everywhere; ``hybrid``: E4M3 forward, E5M2 gradients.
- backend ``torchao`` (default): torchao's float8 training recipes run by moefold's own scaled-GEMM
  autograd functions (``parallel.fp8_cast``) in every column/row-parallel linear (``dense.fp8_linear``)
  and in the grouped expert GEMMs (``moe.fp8_gemm``), on CPU (torch's emulated ``_scaled_mm``) and
  CUDA. Recipes: ``tensorwise`` (one scale per tensor; per expert for the experts) and ``rowwise``
  (one scale per row along each GEMM's contraction dim, power-of-2 scales).
- backend ``te``: Transformer Engine's autocast around TE modules: the linears through ``te.Linear``
  and the experts through ``te.GroupedLinear`` (``--moe-grouped-gemm-backend te``). Recipes:
  ``delayed`` (amax history, TE ``DelayedScaling``), ``tensorwise`` (``Float8CurrentScaling``),
  ``mxfp8`` (32-element blocks, ``MXFP8BlockScaling``; Blackwell GPUs only). TE's autocast is entered
  once per stage forward with the stage's dp x cp x tp group as its amax group (``parallel.fp8_region``);
  its amax history is not checkpointed: a resumed run rebuilds it over its first steps.

The weights stay what they are (fp32 or bf16 parameters, fp32 master weights): only the GEMMs'
operands are cast, so checkpoints, resharding and HF export are the same with and without FP8.
Modules whose qualified name contains one of ``exclude_modules`` (default: the output head) keep
their GEMMs in high precision; the router never runs in FP8 (its GEMM is fp32, ``--moe-router-dtype``).

``dispatch`` (``--moe-fp8-dispatch``, independent of the format) sends the routed tokens to their
experts as E4M3 with per-128-channel scales (``dispatch.fp8_exchange``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
from dataclasses import dataclass
from typing import Any

FP8_FORMATS: tuple[str, ...] = ("e4m3", "hybrid")
FP8_BACKENDS: tuple[str, ...] = ("torchao", "te")
# the recipes each backend runs; the first is its default
BACKEND_RECIPES: dict[str, tuple[str, ...]] = {"torchao": ("tensorwise", "rowwise"),
                                               "te": ("delayed", "tensorwise", "mxfp8")}
FP8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "delayed", "mxfp8")
DEFAULT_EXCLUDE: tuple[str, ...] = ("output_head",)
TE_INSTALL = "pip install --no-build-isolation transformer-engine[pytorch] (needs CUDA)"
TORCHAO_INSTALL = 'pip install torchao==0.18.0 (or pip install -e ".[fp8]")'


@dataclass(frozen=True)
class FP8Config:
    """format: None (FP8 GEMMs off) or one of ``FP8_FORMATS``; recipe: one of the backend's
    ``BACKEND_RECIPES`` (None: its default, filled in when the format is set); backend: one of
    ``FP8_BACKENDS``; exclude_modules: name fragments of modules kept in high precision;
    dispatch: FP8 token dispatch (works with or without FP8 GEMMs)."""

    format: str | None = None
    recipe: str | None = None
    backend: str = "torchao"
    exclude_modules: tuple[str, ...] = DEFAULT_EXCLUDE
    dispatch: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "exclude_modules", tuple(self.exclude_modules))  # a list from JSON
        if self.format is not None and self.format not in FP8_FORMATS:
            raise ValueError(f"--fp8-format={self.format!r} is not one of {', '.join(FP8_FORMATS)}")
        if self.backend not in FP8_BACKENDS:
            raise ValueError(f"--fp8-backend={self.backend!r} is not one of {', '.join(FP8_BACKENDS)}")
        if self.recipe is not None and self.recipe not in FP8_RECIPES:
            raise ValueError(f"--fp8-recipe={self.recipe!r} is not one of {', '.join(FP8_RECIPES)}")
        if self.format is None:
            return
        valid = BACKEND_RECIPES[self.backend]
        if self.recipe is None:
            object.__setattr__(self, "recipe", valid[0])
        elif self.recipe not in valid:
            raise ValueError(f"--fp8-recipe={self.recipe} is not supported by --fp8-backend={self.backend}; "
                             f"it supports {', '.join(valid)}")

    @property
    def enabled(self) -> bool:
        """FP8 GEMMs are on (``dispatch`` is separate)."""
        return self.format is not None

    @property
    def group_alignment(self) -> int:
        """Rows per expert block the FP8 grouped GEMMs want (1 with FP8 GEMMs off): 32 for MXFP8 (32-row scale
        blocks), else 16 (TE's ``Fp8Padding``; torch's ``_scaled_grouped_mm`` takes 16-row aligned groups). The
        flex dispatcher on DeepEP V2 lays its received rows out with this alignment (``expert_alignment``)."""
        if not self.enabled:
            return 1
        return 32 if self.recipe == "mxfp8" else 16

    def describe(self) -> str:
        name = {"torchao": "torchao", "te": "Transformer Engine"}[self.backend]
        gemms = f"fp8 {self.format} {self.recipe} ({name})" if self.enabled else "fp8 off"
        return gemms + (", fp8 dispatch" if self.dispatch else "")

    def te_recipe(self) -> Any:
        """Transformer Engine's recipe object for this config (imports transformer_engine), built once per
        (format, recipe): TE keys its amax buffers by the recipe and refuses to build recipes inside compiled
        regions (``quantization.py`` ``get_default_fp8_recipe``)."""
        return _te_recipe(self.format, self.recipe)

    def check_available(self) -> None:
        """Fail now, naming what is missing, if this config cannot run here (no-op when off)."""
        if not self.enabled:
            return
        if self.backend == "torchao":
            import_torchao()
            return
        import_te("transformer_engine.pytorch")
        self.te_recipe()
        # check_fp8_support() / check_mxfp8_support() -> (ok, reason): in transformer_engine.pytorch.quantization
        # in recent releases, transformer_engine.pytorch.fp8 in older ones (2.8 and before)
        name = "check_mxfp8_support" if self.recipe == "mxfp8" else "check_fp8_support"
        for module in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
            try:
                check = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                continue
            ok, reason = check()
            if not ok:
                raise RuntimeError(f"--fp8-format={self.format} --fp8-recipe={self.recipe}: Transformer Engine "
                                   f"says this device cannot run it: {reason}")
            return


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
def _te_recipe(fmt: str | None, recipe: str | None) -> Any:
    recipe_mod = import_te("transformer_engine.common.recipe")
    fp8_format = recipe_mod.Format.E4M3 if fmt == "e4m3" else recipe_mod.Format.HYBRID
    if recipe == "delayed":
        return recipe_mod.DelayedScaling(fp8_format=fp8_format)
    if recipe == "tensorwise":
        return recipe_mod.Float8CurrentScaling(fp8_format=fp8_format)
    return recipe_mod.MXFP8BlockScaling(fp8_format=fp8_format)


def import_te(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"--fp8-backend te runs through Transformer Engine, which is not installed: "
                          f"{TE_INSTALL}") from err


def add_fp8_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """The FP8 flags (Megatron-LM's names where it has them) on ``parser`` (a parser or an argument group)."""
    parser.add_argument("--fp8-format", default=None, choices=FP8_FORMATS,
                        help="FP8 GEMMs in the linears and the experts: e4m3, or hybrid (e4m3 forward, e5m2 "
                             "gradients); default off")
    parser.add_argument("--fp8-recipe", default=None, choices=FP8_RECIPES,
                        help="FP8 scaling; torchao: tensorwise (default) | rowwise; te: delayed (default) | "
                             "tensorwise | mxfp8 (Blackwell)")
    parser.add_argument("--fp8-backend", default="torchao", choices=FP8_BACKENDS,
                        help="torchao (default; CPU and CUDA) or te (Transformer Engine, CUDA; the experts need "
                             "--moe-grouped-gemm-backend te)")
    parser.add_argument("--fp8-exclude-modules", nargs="*", default=list(DEFAULT_EXCLUDE), metavar="NAME",
                        help="modules whose qualified name contains one of these keep high-precision GEMMs "
                             f"(default: {' '.join(DEFAULT_EXCLUDE)}; e.g. add layers.0. for the first layer)")
    parser.add_argument("--moe-fp8-dispatch", action="store_true",
                        help="send routed tokens to their experts as e4m3 with per-128-channel scales "
                             "(alltoall, allgather and flex on DeepEP V2)")


def fp8_config_from_args(args: argparse.Namespace) -> FP8Config:
    return FP8Config(format=args.fp8_format, recipe=args.fp8_recipe, backend=args.fp8_backend,
                     exclude_modules=tuple(args.fp8_exclude_modules), dispatch=args.moe_fp8_dispatch)


__all__ = ["BACKEND_RECIPES", "FP8_BACKENDS", "FP8_FORMATS", "FP8_RECIPES", "FP8Config", "add_fp8_arguments",
           "fp8_config_from_args", "import_te", "import_torchao"]
