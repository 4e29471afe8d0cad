"""FP8 block-quantised HF checkpoints: the layout DeepSeek-V3, Kimi-K2 and MiniMax-M2 are published in.

On disk (what vLLM / SGLang / transformers' ``FineGrainedFP8Config`` load)::

    config.json:  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}   (+ "modules_to_not_convert")
    <linear>.weight            float8_e4m3fn [N, K]
    <linear>.weight_scale_inv  float32 [ceil(N / 128), ceil(K / 128)]: one per 128x128 block (a ragged last block
                               has its own), the value is ``w_fp8.float() * scale_inv`` block by block

Reading (``Fp8BlockReader``, wrapped around a ``TensorReader`` by ``fp8_reader`` when config.json says so): a
tensor with a ``_scale_inv`` partner is read dequantised, exactly ``w_fp8.float() * scale_inv`` in fp32, for any
box (a rank's slice reads only the blocks it touches); the partners themselves are not separate tensors.
Tensors without one (embeddings, norms, routers, the head) read as stored.

Writing (``convert --to hf --hf-fp8``, ``quantize_block``): every linear weight except the embedding, the head,
the routers, MTP's ``eh_proj`` / ``shared_head`` and ``modules_to_not_convert`` becomes e4m3 with
``scale_inv = amax / 448`` per block (fp32), ``q = clamp(w / scale_inv, +-448)``: the convention of DeepSeek's
``act_quant`` and vLLM's block quantiser. A checkpoint read and written again keeps every FP8 byte; each
``scale_inv`` is recomputed from its dequantised block (``fp32(max|q| * s) / 448``), which gives back ``s`` bit
for bit when the block's largest |q| is 448 (every block this convention writes) except where that fp32
product rounds by an ulp (tests/models/test_hf_fp8.py: none of 154 did). A checkpoint from a quantiser whose
blocks do not reach 448 gets the larger scale ``amax / 448`` (the values stay those of the FP8 grid).

Other quantised formats (GPT-OSS's MXFP4, ...) are refused with one line before any rank starts.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
HUB_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# HF module names never stored in FP8 by the hub checkpoints (and by --hf-fp8)
_KEEP = re.compile(r"(^|\.)(embed_tokens|lm_head|norm|[a-z_]*layernorm|[a-z_]*_norm|gate|router|eh_proj|"
                   r"shared_head\.head|e_score_correction_bias)(\.|$)")


def block_size(config: dict[str, Any] | None) -> tuple[int, int] | None:
    """The weight block of an HF config's ``quantization_config`` (None: not quantised). One-line ValueError
    for a quantisation moefold does not read (only FP8 e4m3 with 2-D weight blocks)."""
    quant = (config or {}).get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method", quant.get("fmt")) if isinstance(quant, dict) else quant
    blocks = quant.get("weight_block_size") if isinstance(quant, dict) else None
    fmt = quant.get("fmt", "e4m3") if isinstance(quant, dict) else None
    if method == "fp8" and fmt in ("e4m3", "float8_e4m3fn") and isinstance(blocks, (list, tuple)) \
            and len(blocks) == 2 and all(isinstance(b, int) and b > 0 for b in blocks):
        if quant.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"quantization_config activation_scheme={quant.get('activation_scheme')!r}: moefold "
                             "reads FP8 block checkpoints with dynamic activation scaling only")
        return int(blocks[0]), int(blocks[1])
    raise ValueError(f"config.json has quantization_config (quant_method={method!r}"
                     + (f", weight_block_size={blocks!r}" if blocks is not None else "") + "): moefold reads FP8 "
                     "e4m3 checkpoints with 2-D weight_block_size (DeepSeek-V3, Kimi-K2, MiniMax-M2) and unquantized "
                     "ones; dequantize others with transformers first (from_pretrained(..., quantization_config="
                     "Mxfp4Config(dequantize=True)), then save_pretrained)")


def dequantize_block(q: Tensor, scale_inv: Tensor, block: tuple[int, int], box: tuple[slice, ...] | None = None,
                     shape: tuple[int, ...] | None = None) -> Tensor:
    """``q.float() * scale_inv`` per block over the last two dims. ``box`` / ``shape``: ``q`` is that slice of a
    tensor of ``shape`` and ``scale_inv`` the blocks it touches (rows from ``box[-2].start // block[0]``...)."""
    shape = shape or tuple(q.shape)
    out = q.float()
    s = scale_inv.float()
    for d, b in ((-2, block[0]), (-1, block[1])):
        start = 0 if box is None else (box[d].start or 0)
        s = s.repeat_interleave(b, dim=d).narrow(d, start - start // b * b, out.shape[d])
    return out * s


def quantize_block(w: Tensor, block: tuple[int, int] = (128, 128)) -> tuple[Tensor, Tensor]:
    """(e4m3 ``q``, fp32 ``scale_inv`` per block) of ``w [..., N, K]`` with ``scale_inv = amax / 448``."""
    *lead, N, K = w.shape
    br, bc = block
    nr, nc = -(-N // br), -(-K // bc)
    x = torch.nn.functional.pad(w.float(), (0, nc * bc - K, 0, nr * br - N))
    blocks = x.reshape(*lead, nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX
    s = scale_inv.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)[..., :N, :K]
    q = (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    return q, scale_inv


def stored_in_fp8(hf_name: str, tensor: Tensor, modules_to_not_convert: list[str] | None = None) -> bool:
    """Whether ``--hf-fp8`` writes ``hf_name`` as FP8 blocks: a 2-D linear ``.weight`` outside ``_KEEP`` and
    ``modules_to_not_convert``."""
    if tensor.dim() != 2 or not hf_name.endswith(".weight") or not tensor.is_floating_point():
        return False
    module = hf_name[: -len(".weight")]
    if _KEEP.search(module):
        return False
    return not any(m and (fnmatch.fnmatch(module, m) or fnmatch.fnmatch(module, m + ".*"))
                   for m in modules_to_not_convert or ())


class Fp8BlockReader:
    """A ``TensorReader`` whose FP8 block-quantised tensors read dequantised (fp32) and whose ``_scale_inv``
    partners are folded into them (module docstring)."""

    def __init__(self, reader: Any, block: tuple[int, int]) -> None:
        self.reader, self.block, self.root = reader, block, reader.root
        self._scaled = {n[: -len(SCALE_SUFFIX)] for n in reader.names() if n.endswith(SCALE_SUFFIX)}
        missing = [n for n in self._scaled if n not in reader]
        if missing:
            raise ValueError(f"{reader.root}: {missing[0]}{SCALE_SUFFIX} has no tensor {missing[0]!r} to scale")

    def __contains__(self, name: str) -> bool:
        return name in self.reader and not (name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in self._scaled)

    def names(self) -> list[str]:
        return [n for n in self.reader.names() if n in self]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.shape(name)

    def is_fp8(self, name: str) -> bool:
        return name in self._scaled

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> Tensor:
        if name not in self._scaled:
            return self.reader.read(name, box)
        shape = self.reader.shape(name)
        q = self.reader.read(name, box)
        full = box is None or len(box) < len(shape)
        if full and box is not None:   # leading dims only: the last two whole
            box = tuple(box) + tuple(slice(0, n) for n in shape[len(box):])
        scale_box = None
        if box is not None:
            scale_box = tuple(box[:-2]) + tuple(
                slice((sl.start or 0) // b, -(-(sl.stop if sl.stop is not None else n) // b))
                for sl, b, n in zip(box[-2:], self.block, shape[-2:]))
        s = self.reader.read(name + SCALE_SUFFIX, scale_box)
        return dequantize_block(q, s, self.block, box, shape)

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> Fp8BlockReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fp8_reader(reader: Any, hf_config: dict[str, Any] | None) -> Any:
    """``reader`` itself for an unquantised checkpoint, an ``Fp8BlockReader`` over it for an FP8 block one."""
    if isinstance(reader, Fp8BlockReader):
        return reader
    block = block_size(hf_config)
    return reader if block is None else Fp8BlockReader(reader, block)


__all__ = ["HUB_CONFIG", "Fp8BlockReader", "block_size", "dequantize_block", "fp8_reader", "quantize_block",
           "stored_in_fp8"]
