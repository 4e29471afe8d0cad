"""The layout's sizes: ``ParallelConfig`` (what the flags ask for) and ``ParallelSizes`` (resolved for a world,
every size checked to divide). Torch-free, so that ``moefold train`` checks a layout before torch is imported;
``parallel.dims.ParallelDims`` builds the process groups from them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """Requested sizes. ``dp=None`` means "whatever is left": world / (tp * cp * pp)."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int | None = None
    ep: int = 1
    etp: int = 1

    def resolve(self, world_size: int) -> ParallelSizes:
        """Infer dp and edp for ``world_size`` and check that every size divides cleanly."""
        for name in ("tp", "cp", "pp", "ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.dp is not None and (not isinstance(self.dp, int) or self.dp < 1):
            raise ValueError(f"dp={self.dp!r} must be a positive integer (or None to infer it)")
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be a positive integer")
        tp, cp, pp, ep, etp = self.tp, self.cp, self.pp, self.ep, self.etp
        model = tp * cp * pp
        if world_size % model != 0:
            raise ValueError(
                f"world_size={world_size} is not divisible by tp*cp*pp={tp}*{cp}*{pp}={model}"
            )
        dp = world_size // model if self.dp is None else self.dp
        if tp * cp * dp * pp != world_size:
            raise ValueError(
                f"tp*cp*dp*pp={tp}*{cp}*{dp}*{pp}={tp * cp * dp * pp} does not equal "
                f"world_size={world_size}; use dp={world_size // model} or leave dp unset"
            )
        per_stage = tp * cp * dp
        if per_stage % (etp * ep) != 0:
            raise ValueError(
                f"etp*ep={etp}*{ep}={etp * ep} does not divide tp*cp*dp={tp}*{cp}*{dp}={per_stage} "
                f"(the ranks of one pipeline stage); valid etp*ep are the divisors of {per_stage}"
            )
        return ParallelSizes(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp,
                             edp=per_stage // (etp * ep), world_size=world_size)


@dataclass(frozen=True)
class ParallelSizes:
    """Fully resolved, validated sizes (dp and edp filled in)."""

    tp: int
    cp: int
    pp: int
    dp: int
    ep: int
    etp: int
    edp: int
    world_size: int

    def dense_coords(self, rank: int) -> dict[str, int]:
        """{tp, cp, dp, pp} coordinates of ``rank`` in the dense layout."""
        return _coords(rank, (("tp", self.tp), ("cp", self.cp), ("dp", self.dp), ("pp", self.pp)))

    def expert_coords(self, rank: int) -> dict[str, int]:
        """{etp, ep, edp, pp} coordinates of ``rank`` in the expert layout."""
        return _coords(rank, (("etp", self.etp), ("ep", self.ep), ("edp", self.edp), ("pp", self.pp)))


def _coords(rank: int, dims: tuple[tuple[str, int], ...]) -> dict[str, int]:
    out = {}
    for name, size in dims:  # innermost first
        out[name] = rank % size
        rank //= size
    return out


__all__ = ["ParallelConfig", "ParallelSizes"]
