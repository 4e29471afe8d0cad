"""``GemmBackend``: the routed experts' GEMM backends (``--moe-grouped-gemm-backend``; what each one does is
``moe.gemm``'s docstring). Torch-free, so that the CLI parses its flags and the configs check their values before
torch is imported; ``moe.gemm`` runs them."""

from __future__ import annotations

from enum import StrEnum


class GemmBackend(StrEnum):
    """The routed experts' GEMM backend (module docstring)."""

    GROUPED_MM = "grouped_mm"
    LOOP = "loop"
    GROUPED_GEMM = "grouped_gemm"
    TE = "te"

    @classmethod
    def _missing_(cls, value: object) -> GemmBackend:
        raise ValueError(f"unknown gemm backend {value!r} (gemm_backend={value!r}, --moe-grouped-gemm-backend); "
                         f"valid backends: {', '.join(cls)}")

    @property
    def needs_host_counts(self) -> bool:
        """The backend takes its group sizes as host integers."""
        return self is not GemmBackend.GROUPED_MM


__all__ = ["GemmBackend"]
