"""Which GEMMs of a built model run in FP8, and with which backend: for the run header, the metrics
line (``MetricsLogger(fp8=...)``) and ``moefold env`` (what each FP8 backend would use here)."""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from moefold.execution.fp8_linear import fp8_linear_names
from moefold.moe.experts import GroupedExperts
from moefold.precision.fp8 import FP8Config


def fp8_expert_layers(model: nn.Module) -> tuple[list[str], list[str]]:
    """(names of the GroupedExperts whose two GEMMs run in FP8, names of those in high precision)."""
    fp8, high = [], []
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            (fp8 if module.config.fp8_gemms is not None else high).append(name)
    return fp8, high


def fp8_summary(model: nn.Module, config: FP8Config) -> str:
    """One line for the run header: the recipe, the backend, what runs in FP8 and what does not."""
    if not config.enabled:
        return "fp8 dispatch (tokens travel as e4m3); GEMMs in high precision" if config.dispatch else "fp8 off"
    linears, kept = fp8_linear_names(model)
    experts, _ = fp8_expert_layers(model)
    parts = [f"{len(linears)} linear layers"] + ([f"the expert GEMMs of {len(experts)} MoE layers"] if experts else [])
    return (f"{config.describe()}: {', '.join(parts)} in FP8; high precision: {', '.join(kept) or 'no linear'}, "
            "the routers")


def fp8_tag(model: nn.Module, config: FP8Config) -> str | None:
    """The short form for every metrics line, e.g. ``fp8 torchao: 25 lin + 2 exp``; None when off."""
    if not config.enabled and not config.dispatch:
        return None
    tag = f"fp8 {config.backend}" if config.enabled else "fp8"
    if config.enabled:
        tag += f": {len(fp8_linear_names(model)[0])} lin + {len(fp8_expert_layers(model)[0])} exp"
    return tag + (" + dispatch" if config.dispatch else "")


def env_lines() -> list[str]:
    """``moefold env``: what each FP8 backend runs on this machine."""
    cuda = torch.cuda.is_available()
    cap = torch.cuda.get_device_capability() if cuda else None
    if cuda:
        hw = (f"CUDA sm{cap[0]}{cap[1]}: " +
              ("FP8 tensor cores" if cap >= (8, 9) else "no FP8 tensor cores (needs compute capability 8.9+)"))
        grouped = ("torch._scaled_grouped_mm" if cap[0] in (9, 10) and hasattr(torch, "_scaled_grouped_mm")
                   else "per-expert torch._scaled_mm (torch._scaled_grouped_mm needs sm90/sm100)")
    else:
        hw = "CPU: FP8 emulated (torch._scaled_mm dequantises and runs an fp32 GEMM): numerics only, no speed-up"
        grouped = "per-expert torch._scaled_mm (torch._scaled_grouped_mm is CUDA only)"
    if importlib.util.find_spec("torchao") is None:
        torchao = "torchao not installed (pip install torchao==0.18.0)"
    else:
        from moefold.precision.fp8 import import_torchao

        try:
            import_torchao()
            from importlib.metadata import version

            torchao = f"torchao {version('torchao')}"
        except Exception as exc:
            torchao = f"torchao fails to import: {type(exc).__name__}: {exc}"
    te = "available" if importlib.util.find_spec("transformer_engine") is not None else "not installed"
    return [f"fp8 (--fp8-backend torchao): {torchao}; {hw}; linears: torch._scaled_mm; experts: {grouped}",
            f"fp8 (--fp8-backend te): Transformer Engine {te}; linears: te.Linear, experts: te.GroupedLinear "
            "(--moe-grouped-gemm-backend te); CUDA only"]


__all__ = ["env_lines", "fp8_expert_layers", "fp8_summary", "fp8_tag"]
