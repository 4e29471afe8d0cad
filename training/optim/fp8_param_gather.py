"""``--fp8-param-gather``: the distributed optimizer all-gathers FP8 weights (1 byte per element) from fp32 masters.

The weights whose GEMMs run in FP8 carry their quantisation (``precision.fp8_param.FP8ParamSpec``: one scale
per matrix, or per 128x128 block) and sit in flat groups of their own (``training.optim.buffers``). After the
optimizer updated this rank's chunk of such a bucket (fp32 masters), the bucket's gather is::

    amax:      per block of every weight in the bucket, from this rank's chunk (its blocks' pieces), then
               all-reduced (MAX) over the bucket's group (the other chunks) and over the groups the weight is
               sharded on where its GEMM reduces them (``split``): every rank gets the full weight's amaxes
    quantise:  q = saturate(master * scale) as e4m3, scale = 448 / amax (torchao's ``amax_to_scale``, as the
               GEMM's weight cast computes it)
    gather:    the e4m3 bytes of every chunk (1 byte per element: a quarter of fp32, half of bf16)
    dequantise into the parameters: param = q * (1 / scale), in the parameters' dtype

so every replica holds the FP8 weight the GEMMs multiply; the GEMM's own cast of it (its scale re-derived from
the amax of these values) gives back the same FP8 values with the same scale, so the numerics are those of the run
without the flag bit for bit (fp32 parameters; ``_dequantize`` keeps each block's amax the masters' to the last bit:
tests/training/optim/test_fp8_param_gather.py). The collectives per bucket: the
amax all-reduce (a few floats per weight: one per matrix or per 128x128 block), and the byte all-gather.

Megatron keeps the parameters themselves as FP8 tensors (TE ``Float8Tensor``), saving their memory too; here
they stay in their dtype (every non-FP8 consumer, checkpoints and HF export read them unchanged): what is
saved is the all-gather's bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from moefold.parallel.groups import group_size
from moefold.precision.fp8_cast import E4M3, _float8_utils, amax_to_scale
from moefold.precision.fp8_param import FP8ParamSpec, fp8_param_spec
from moefold.training.optim.buffers import Bucket, FlatGroup
from moefold.training.optim.grad_sync import all_gather_into

E4M3_MAX = torch.finfo(E4M3).max


def _block_ids(spec: FP8ParamSpec, lo: int, hi: int, device: torch.device) -> tuple[Tensor, int]:
    """(block of each flat element ``[lo, hi)`` of the weight, blocks per weight)."""
    R, C = spec.rows, spec.cols
    idx = torch.arange(lo, hi, device=device)
    m, rem = idx // (R * C), idx % (R * C)
    r, c = rem // C, rem % C
    br, bc = spec.block or (R, C)
    nbr, nbc = -(-R // br), -(-C // bc)
    return m * (nbr * nbc) + (r // br) * nbc + c // bc, nbr * nbc


def _dequantize(q_MRC: Tensor, inv: Tensor, amax: Tensor, spec: FP8ParamSpec) -> Tensor:
    """fp32 ``q * inv`` of ``q_MRC`` (``M`` matrices of ``spec``'s ``rows x cols``), ``inv`` one inverse scale per
    matrix or per block (row-major over each matrix's blocks, a ragged last block included), except that an element
    at the format's maximum (448) becomes its block's ``amax`` (signed): the block's amax is then the masters' to the
    last bit, so the GEMM's cast re-derives the very scale it was quantised with (``448 * inv`` is the amax only to
    fp32 rounding; a scale off in its last bit moves every GEMM output by ~1e-7, enough to flip an activation's FP8
    rounding downstream). That element's FP8 value is unchanged: ``amax * scale`` rounds to 448."""
    M, R, C = q_MRC.shape
    x = q_MRC.float()
    if spec.block is None:
        s, a = inv.view(M, 1, 1), amax.view(M, 1, 1)
    else:
        br, bc = spec.block
        nbr, nbc = -(-R // br), -(-C // bc)
        s, a = inv.view(M, nbr, nbc), amax.view(M, nbr, nbc)
        if R % br == 0 and C % bc == 0:
            x = x.view(M, nbr, br, nbc, bc)
            s, a = s[:, :, None, :, None], a[:, :, None, :, None]
        else:
            s, a = (t.repeat_interleave(br, dim=1)[:, :R].repeat_interleave(bc, dim=2)[:, :, :C] for t in (s, a))
    out = torch.where(x.abs() == E4M3_MAX, a.expand_as(x).copysign(x), x * s)
    return out.view(M, R, C)


def _reduce_groups(spec: FP8ParamSpec) -> list:
    """The split groups whose amaxes the weight's GEMM reduces (tensorwise: every one; blocks: a dim that is
    one block altogether)."""
    out = []
    for g, n, b in ((spec.split[0], spec.rows, (spec.block or (0, 0))[0]), (spec.split[1], spec.cols,
                                                                             (spec.block or (0, 0))[1])):
        if group_size(g) > 1 and (spec.block is None or n * group_size(g) <= b):
            out.append(g)
    return out


class FP8BucketGather:
    """The FP8 all-gather of one bucket of an FP8 flat group (module docstring)."""

    def __init__(self, g: FlatGroup, b: Bucket) -> None:
        self.g, self.b = g, b
        device = g.param_data.device
        self.items = []   # (param index, spec, offset of its amaxes, blocks per matrix)
        n = 0
        for i in b.params:
            p = g.params[i]
            spec = fp8_param_spec(p)
            matrices = p.numel() // (spec.rows * spec.cols)
            _, per = _block_ids(spec, 0, 0, device)
            self.items.append((i, spec, n, per * matrices))
            n += per * matrices
        self.num_amax = n

    def launch(self, master: Tensor) -> Callable[[], None]:
        """Quantise this rank's chunk (``master``: its fp32 values), start the gather; returns the finish (wait,
        dequantise into the parameters)."""
        g, b = self.g, self.b
        lo, hi = g.owned(b)
        device = g.param_data.device
        amax = torch.zeros(self.num_amax, dtype=torch.float32, device=device)
        ids_chunk = torch.full((hi - lo,), self.num_amax, dtype=torch.long, device=device)   # padding: a sink
        for (i, spec, off, _), (j, a, z) in zip(self.items, self._pieces()):
            assert i == j
            if a is None:
                continue
            ids, _ = _block_ids(spec, a, z, device)
            at = g.offsets[i] + a - lo
            ids_chunk[at:at + z - a] = ids + off
        values = master.detach().float().abs()
        sink = torch.zeros(self.num_amax + 1, dtype=torch.float32, device=device)
        amax = sink.scatter_reduce_(0, ids_chunk, values, "amax")[:-1].contiguous()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=g.group)
        for group, parts in self._by_group().items():
            buf = torch.cat([amax[o:o + n] for o, n in parts])
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
            at = 0
            for o, n in parts:
                amax[o:o + n] = buf[at:at + n]
                at += n
        scale = amax_to_scale(amax, E4M3, False)
        inv = torch.cat([scale.reciprocal(), scale.new_zeros(1)])
        amax = torch.cat([amax, amax.new_zeros(1)])
        scale = torch.cat([scale, scale.new_zeros(1)])
        q = _float8_utils().to_fp8_saturated(master.detach().float() * scale[ids_chunk], E4M3)
        gathered = torch.empty(b.end - b.start, dtype=torch.uint8, device=device)
        work = all_gather_into(gathered, q.view(torch.uint8), group=g.group, async_op=True)

        def finish() -> None:
            work.wait()
            data = gathered.view(E4M3)
            for i, spec, off, n in self.items:   # per weight: its scales broadcast over its blocks, no index tensor
                lo, numel = g.offsets[i], g.params[i].numel()
                q = data[lo - b.start:lo - b.start + numel].view(-1, spec.rows, spec.cols)
                g.param_data[lo:lo + numel].view_as(q).copy_(_dequantize(q, inv[off:off + n], amax[off:off + n], spec))
        return finish

    def _pieces(self):
        """(param index, lo, hi) of this rank's chunk for every item, (index, None, None) where it has none."""
        mine = {i: (a, z) for i, a, z in self.g.pieces(self.b)}
        return [(i, *mine.get(i, (None, None))) for i, *_ in self.items]

    def _by_group(self) -> dict:
        out: dict = {}
        for _, spec, off, n in self.items:
            for group in _reduce_groups(spec):
                out.setdefault(group, []).append((off, n))
        return out


def bytes_per_element(g: FlatGroup) -> int:
    """What one element of ``g``'s parameter all-gather costs: 1 (FP8) or the parameters' dtype."""
    return 1 if g.fp8 else g.param_data.element_size()


__all__ = ["FP8BucketGather", "bytes_per_element"]
