"""The names and checks of the dense stack's run-time choices, torch-free so that ``moefold train`` parses and
checks its flags (and ``ModelOptions`` validates them) before torch is imported: recompute (``dense.recompute``),
fine-grained activation offloading (``dense.activation_offload``, whose docstring tables the modules), the
context-parallel exchange (``dense.context_parallel``) and the Gated DeltaNet kernel (``dense.gated_delta_rule``).
Those modules re-export these names; the mechanisms stay with them."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum


class CPComm(StrEnum):
    """--cp-comm-type: the context-parallel K/V exchange (``dense.context_parallel``): a ring of point-to-point
    steps overlapped with attention, or one all-gather. The configs that take it store the enum."""

    P2P = "p2p"
    ALL_GATHER = "all_gather"

    @classmethod
    def _missing_(cls, value: object) -> CPComm:
        raise ValueError(f"cp_comm={value!r} is not one of {', '.join(cls)}")


CP_COMM_MODES: tuple[str, ...] = tuple(m.value for m in CPComm)   # context-parallel K/V exchange



class Recompute(StrEnum):
    """--recompute-granularity: nothing, the ``--recompute-modules`` (``dense.recompute``), or whole blocks. The
    configs that take it store the enum (``check_recompute``); the layers compare the enum, never its text."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class DeltaRuleBackend(StrEnum):
    """Gated DeltaNet's kernel (``--linear-attention-backend``): fla on CUDA when installed (``AUTO``), the chunked
    torch form, or flash-linear-attention."""

    AUTO = "auto"
    TORCH = "torch"
    FLA = "fla"


RECOMPUTE_MODES = tuple(m.value for m in Recompute)
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "moe_act", "shared_experts", "layernorm", "mla_up_proj")


class RecomputeMethod(StrEnum):
    """--recompute-method (full recompute): groups of N layers, or the first N layers of each pipeline chunk."""

    UNIFORM = "uniform"
    BLOCK = "block"


RECOMPUTE_METHODS = tuple(m.value for m in RecomputeMethod)
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)


GATED_DELTA_RULE_BACKENDS: tuple[str, ...] = tuple(b.value for b in DeltaRuleBackend)


class MambaBackend(StrEnum):
    """Mamba-2's scan and convolution (``--mamba-backend``, ``dense.mamba2_kernels``): the torch chunked form (any
    device) or the ``mamba_ssm`` / ``causal_conv1d`` CUDA kernels."""

    TORCH = "torch"
    MAMBA_SSM = "mamba_ssm"

    @classmethod
    def _missing_(cls, value: object) -> MambaBackend:
        raise ValueError(f"mamba backend {value!r} is not one of {', '.join(m.value for m in cls)}")


MAMBA_BACKENDS: tuple[str, ...] = tuple(b.value for b in MambaBackend)


def check_recompute(mode: str, where: str = "recompute") -> Recompute:
    """``mode`` as a ``Recompute`` if it is one of ``RECOMPUTE_MODES``, else raise a ValueError naming it."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"{where}={mode!r} is not one of {RECOMPUTE_MODES}")
    return Recompute(mode)


def check_recompute_modules(modules: Sequence[str], where: str = "--recompute-modules") -> tuple[str, ...]:
    """The modules as a tuple; ValueError naming an unknown one."""
    bad = [m for m in modules if m not in RECOMPUTE_MODULES]
    if bad:
        raise ValueError(f"{where}: {', '.join(map(repr, bad))} not among {', '.join(RECOMPUTE_MODULES)}")
    return tuple(modules)


OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act",
                   "shared_experts")
# offload module -> the recompute modules (dense.recompute) that recompute (or free) the same tensors
RECOMPUTE_CONFLICTS = {"attn_norm": ("layernorm",), "mlp_norm": ("layernorm",), "core_attn": ("core_attn",),
                       "qkv_linear": ("mla_up_proj",), "expert_fc1": ("moe",), "moe_act": ("moe_act", "moe"),
                       "shared_experts": ("shared_experts", "moe")}
MIN_OFFLOADED_TENSOR_SIZE = 1024 * 1024   # Megatron's --min-offloaded-tensor-size default (elements)


def check_offload_modules(modules: Sequence[str], where: str = "--offload-modules") -> tuple[str, ...]:
    """The modules as a tuple (duplicates removed, order kept); ValueError naming an unknown one."""
    bad = [m for m in modules if m not in OFFLOAD_MODULES]
    if bad:
        raise ValueError(f"{where}: {', '.join(map(repr, bad))} not among {', '.join(OFFLOAD_MODULES)}")
    return tuple(dict.fromkeys(modules))


def check_offload(modules: Sequence[str], recompute: str, recompute_modules: Sequence[str]) -> None:
    """ValueError (one line) when an offloaded module is also recomputed, with full recompute, or ``attn_proj``
    without ``core_attn`` (Megatron's rule: the projection's input is core attention's output, which core
    attention keeps too, so offloading it alone frees nothing)."""
    if not modules:
        return
    if "attn_proj" in modules and "core_attn" not in modules:
        raise ValueError("--offload-modules attn_proj needs core_attn as well: the output projection's input is "
                         "core attention's output, which core attention keeps for its own backward")
    if recompute == Recompute.FULL:
        raise ValueError(f"--offload-modules {' '.join(modules)} with --recompute-granularity full: a fully "
                         "recomputed layer keeps only its input, there is nothing to offload; use selective "
                         "recompute or no recompute")
    if recompute != Recompute.SELECTIVE:
        return
    for m in modules:
        both = [r for r in RECOMPUTE_CONFLICTS.get(m, ()) if r in recompute_modules]
        if both:
            raise ValueError(f"--offload-modules {m} and --recompute-modules {both[0]}: a module is recomputed or "
                             "offloaded, not both; drop one of them")


__all__ = ["CPComm", "DeltaRuleBackend", "MAMBA_BACKENDS", "MambaBackend", "Recompute", "RecomputeMethod",
           "CP_COMM_MODES", "DEFAULT_RECOMPUTE_MODULES", "GATED_DELTA_RULE_BACKENDS", "MIN_OFFLOADED_TENSOR_SIZE",
           "OFFLOAD_MODULES", "RECOMPUTE_CONFLICTS", "RECOMPUTE_METHODS", "RECOMPUTE_MODES", "RECOMPUTE_MODULES",
           "check_offload", "check_offload_modules", "check_recompute", "check_recompute_modules"]
