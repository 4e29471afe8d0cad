"""FP8 training settings (Megatron's ``--fp8-format`` / ``--fp8-recipe``), in one typed place.

``FP8Config`` is what a run asks for; ``add_fp8_arguments`` / ``fp8_config_from_args`` are the
only definitions of its flags, so a new backend or recipe is added here once. Today FP8 runs
through Transformer Engine: ``te_recipe`` builds TE's recipe object and ``te_autocast`` enters
TE's autocast around TE modules (moefold's expert GEMMs with ``--moe-grouped-gemm-backend te``).
Nothing else (torch linears, attention) runs in FP8.

- format ``e4m3``: E4M3 everywhere; ``hybrid``: E4M3 forward, E5M2 gradients.
- recipe ``delayed``: per-tensor scales from an amax history (TE ``DelayedScaling``);
  ``tensorwise``: per-tensor scales from the current amax (``Float8CurrentScaling``);
  ``mxfp8``: 32-element block scales (``MXFP8BlockScaling``; Blackwell GPUs only).

The amax history of ``delayed`` lives in the TE modules and is not reduced across ranks
(``amax_reduction_group=None``): each rank scales its own experts' tensors, which is what
expert parallelism shards anyway. It is not written to checkpoints: a resumed run rebuilds it
over its first steps.
"""

from __future__ import annotations

import argparse
import importlib
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

FP8_FORMATS: tuple[str, ...] = ("e4m3", "hybrid")
FP8_RECIPES: tuple[str, ...] = ("delayed", "tensorwise", "mxfp8")
TE_INSTALL = "pip install --no-build-isolation transformer-engine[pytorch] (needs CUDA)"


@dataclass(frozen=True)
class FP8Config:
    """format: None (FP8 off) or one of ``FP8_FORMATS``; recipe: one of ``FP8_RECIPES``."""

    format: str | None = None
    recipe: str = "delayed"

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in FP8_FORMATS:
            raise ValueError(f"--fp8-format={self.format!r} is not one of {', '.join(FP8_FORMATS)}")
        if self.recipe not in FP8_RECIPES:
            raise ValueError(f"--fp8-recipe={self.recipe!r} is not one of {', '.join(FP8_RECIPES)}")

    @property
    def enabled(self) -> bool:
        return self.format is not None

    def describe(self) -> str:
        return f"fp8 {self.format} {self.recipe} (Transformer Engine)" if self.enabled else "fp8 off"

    def te_recipe(self) -> Any:
        """Transformer Engine's recipe object for this config (imports transformer_engine)."""
        recipe_mod = _import_te("transformer_engine.common.recipe")
        fmt = recipe_mod.Format.E4M3 if self.format == "e4m3" else recipe_mod.Format.HYBRID
        if self.recipe == "delayed":
            return recipe_mod.DelayedScaling(fp8_format=fmt)
        if self.recipe == "tensorwise":
            return recipe_mod.Float8CurrentScaling(fp8_format=fmt)
        return recipe_mod.MXFP8BlockScaling(fp8_format=fmt)

    def check_available(self) -> None:
        """Fail now, naming what is missing, if this config cannot run here (no-op when off)."""
        if not self.enabled:
            return
        _import_te("transformer_engine.pytorch")
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


def te_autocast(config: FP8Config | None) -> AbstractContextManager:
    """Transformer Engine's FP8 autocast for ``config`` (a null context when FP8 is off).

    Recent TE releases name it ``autocast(enabled, recipe=...)`` (``fp8_autocast`` is deprecated
    there); 2.8 and older only have ``fp8_autocast(enabled, fp8_recipe=...)``. Enter it once per
    module call: with ``delayed`` scaling TE reduces the amax when the context exits, so one module
    must not run twice inside one context.
    """
    if config is None or not config.enabled:
        return nullcontext()
    te = _import_te("transformer_engine.pytorch")
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=config.te_recipe())
    return te.fp8_autocast(enabled=True, fp8_recipe=config.te_recipe())


def _import_te(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"FP8 (--fp8-format) runs through Transformer Engine, which is not installed: "
                          f"{TE_INSTALL}") from err


def add_fp8_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """The FP8 flags (Megatron-LM's names) on ``parser`` (a parser or an argument group)."""
    parser.add_argument("--fp8-format", default=None, choices=FP8_FORMATS,
                        help="FP8 for Transformer Engine modules (the experts with --moe-grouped-gemm-backend te): "
                             "e4m3, or hybrid (e4m3 forward, e5m2 gradients); default off")
    parser.add_argument("--fp8-recipe", default="delayed", choices=FP8_RECIPES,
                        help="FP8 scaling: delayed (amax history), tensorwise (current amax), mxfp8 (Blackwell)")


def fp8_config_from_args(args: argparse.Namespace) -> FP8Config:
    return FP8Config(format=args.fp8_format, recipe=args.fp8_recipe)


__all__ = ["FP8_FORMATS", "FP8_RECIPES", "FP8Config", "add_fp8_arguments", "fp8_config_from_args", "te_autocast"]
