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
blocks do not reach 448 gets the larger scale ``amax / 448`` (the values stay those of the FP8 grid). A
DeepSeek-V4 model is written in V4-Flash's published form (``quantized_tensors(..., v4=True)``, ``V4_CONFIG``):
ue8m0 ``X.scale`` partners and FP4 routed experts; read back, every value is kept (a power-of-two scale recomputed
from a block whose largest |q| rounded to the grid's half may halve, with the codes doubled to the same values).

DeepSeek-V4's published form (``models.hf.fp4_experts``) reads through the same reader: ``scale_fmt: "ue8m0"``
(scales stored as float8_e8m0fnu powers of two, or their ``uint8`` exponent bytes), partners named ``X.scale``
beside ``X.weight`` (DeepSeek's spelling, which transformers renames to ``weight_scale_inv``), and with
``expert_dtype: "fp4"`` (top-level in V4's config.json, inside ``quantization_config`` in V4.1's) routed experts
packed two e2m1 values per byte with a scale per row and 32 values along K. ``shape`` reports the logical
(unpacked) shape, so parameter counts and shape checks are those of the unquantised model.

``quant_format`` reads every ``quantization_config`` field (``QuantFormat``) or refuses it in one line; other
quantised formats (GPT-OSS's MXFP4, ...) are refused with one line before any rank starts.
"""

from __future__ import annotations

import enum
import fnmatch
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moefold.models.hf.fp4_experts import (
    PACKED_DTYPES,
    SCALE_DTYPES,
    check_fp4_shapes,
    dequantize_fp4,
    fp4_read_boxes,
    quantize_fp4,
    scale_to_fp32,
    ue8m0_scale,
)

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
V4_SCALE_SUFFIX = ".scale"     # DeepSeek-V4's spelling: X.scale beside X.weight
FP8_DTYPES = ("F8_E4M3",)
HUB_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
V4_CONFIG = {**HUB_CONFIG, "scale_fmt": "ue8m0"}   # DeepSeek-V4-Flash's (with "expert_dtype": "fp4" top-level)
# HF module names never stored in FP8 by the hub checkpoints (and by --hf-fp8); embed / head: DeepSeek-V4's names
_KEEP = re.compile(r"(^|\.)(embed_tokens|lm_head|embed|head|norm|[a-z_]*layernorm|[a-z_]*_norm|gate|router|eh_proj|"
                   r"shared_head\.head|e_score_correction_bias)(\.|$)")


class ScaleFormat(enum.Enum):
    FLOAT = "float"     # fp32 scale_inv (DeepSeek-V3)
    UE8M0 = "ue8m0"     # powers of two in float8_e8m0fnu (DeepSeek-V4)


class ExpertDtype(enum.Enum):
    FP8 = "fp8"         # routed experts in e4m3 blocks, like every other linear
    FP4 = "fp4"         # routed experts packed e2m1 with a scale per row and 32 values (DeepSeek-V4)


@dataclass(frozen=True)
class QuantFormat:
    """A checkpoint's ``quantization_config`` as moefold reads it."""

    block: tuple[int, int]                  # weight_block_size of the FP8 (non-FP4) weights
    scale_fmt: ScaleFormat = ScaleFormat.FLOAT
    expert_dtype: ExpertDtype = ExpertDtype.FP8
    modules_to_not_convert: tuple[str, ...] = ()


# quantization_config fields moefold reads or names inert (FineGrainedFP8Config's, transformers 5.25)
_FIELDS = {"quant_method", "fmt", "weight_block_size", "activation_scheme", "scale_fmt", "expert_dtype",
           "modules_to_not_convert", "ignored_layers",   # MiniMax's alias of modules_to_not_convert
           "modules_to_convert",   # e.g. FP8 embeddings: any tensor with a scale partner is read dequantised
           "dequantize"}           # transformers' loading switch; moefold always reads dequantised


def _refuse(method: Any, blocks: Any) -> ValueError:
    return ValueError(f"config.json has quantization_config (quant_method={method!r}"
                      + (f", weight_block_size={blocks!r}" if blocks is not None else "") + "): moefold reads FP8 "
                      "e4m3 checkpoints with 2-D weight_block_size (DeepSeek-V3 / V4, Kimi-K2, MiniMax-M2) and "
                      "unquantized ones; dequantize others with transformers first (from_pretrained(..., "
                      "quantization_config=Mxfp4Config(dequantize=True)), then save_pretrained)")


def quant_format(config: dict[str, Any] | None) -> QuantFormat | None:
    """The ``QuantFormat`` of an HF config.json (None: not quantised). A top-level ``expert_dtype`` (DeepSeek-V4's
    place) is folded into ``quantization_config`` unless that names one (V4.1's), as ``DeepseekV4Config`` folds
    it; without a ``quantization_config`` it is ignored, as transformers ignores it. One-line ValueError for a
    quantisation moefold does not read or a field it does not know."""
    quant = (config or {}).get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise _refuse(quant, None)
    if (config or {}).get("expert_dtype") is not None and "expert_dtype" not in quant:
        quant = {**quant, "expert_dtype": config["expert_dtype"]}
    method, blocks = quant.get("quant_method", quant.get("fmt")), quant.get("weight_block_size")
    if not (method == "fp8" and quant.get("fmt", "e4m3") in ("e4m3", "float8_e4m3fn")
            and isinstance(blocks, (list, tuple)) and len(blocks) == 2
            and all(isinstance(b, int) and b > 0 for b in blocks)):
        raise _refuse(method, blocks)
    unknown = sorted(set(quant) - _FIELDS)
    if unknown:
        raise ValueError(f"quantization_config fields {unknown} are not read by moefold (known: {sorted(_FIELDS)})")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"quantization_config activation_scheme={quant.get('activation_scheme')!r}: moefold "
                         "reads FP8 block checkpoints with dynamic activation scaling only")
    fields = {}
    for key, kind in (("scale_fmt", ScaleFormat), ("expert_dtype", ExpertDtype)):
        value = quant.get(key, next(iter(kind)).value)
        try:
            fields[key] = kind(value)
        except ValueError:
            raise ValueError(f"quantization_config {key}={value!r}; valid: {[k.value for k in kind]}") from None
    keep = quant.get("modules_to_not_convert") or quant.get("ignored_layers") or []
    if not isinstance(keep, (list, tuple)) or not all(isinstance(m, str) for m in keep):
        raise ValueError(f"quantization_config modules_to_not_convert={keep!r}: a list of module names")
    return QuantFormat((int(blocks[0]), int(blocks[1])), modules_to_not_convert=tuple(keep), **fields)


def block_size(config: dict[str, Any] | None) -> tuple[int, int] | None:
    """The FP8 weight block of an HF config's ``quantization_config`` (None: not quantised); ``quant_format``'s
    one-line ValueError for a quantisation moefold does not read."""
    fmt = quant_format(config)
    return None if fmt is None else fmt.block


def dequantize_block(q: Tensor, scale_inv: Tensor, block: tuple[int, int], box: tuple[slice, ...] | None = None,
                     shape: tuple[int, ...] | None = None) -> Tensor:
    """``q.float() * scale_inv`` per block over the last two dims. ``box`` / ``shape``: ``q`` is that slice of a
    tensor of ``shape`` and ``scale_inv`` the blocks it touches (rows from ``box[-2].start // block[0]``...)."""
    shape = shape or tuple(q.shape)
    out = q.float()
    s = scale_to_fp32(scale_inv)
    for d, b in ((-2, block[0]), (-1, block[1])):
        start = 0 if box is None else (box[d].start or 0)
        s = s.repeat_interleave(b, dim=d).narrow(d, start - start // b * b, out.shape[d])
    return out * s


def quantize_block(w: Tensor, block: tuple[int, int] = (128, 128), ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    """(e4m3 ``q``, fp32 ``scale_inv`` per block) of ``w [..., N, K]`` with ``scale_inv = amax / 448``; ``ue8m0``:
    ``scale_inv = 2 ** ceil(log2(amax / 448))`` stored as float8_e8m0fnu (DeepSeek-V4, transformers'
    ``Fp8Quantize`` with ``scale_fmt="ue8m0"``)."""
    *lead, N, K = w.shape
    br, bc = block
    nr, nc = -(-N // br), -(-K // bc)
    x = torch.nn.functional.pad(w.float(), (0, nc * bc - K, 0, nr * br - N))
    blocks = x.reshape(*lead, nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale_inv = ue8m0_scale(amax, FP8_MAX) if ue8m0 else amax.clamp(min=1e-12) / FP8_MAX
    s = scale_inv.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)[..., :N, :K]
    q = (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    return q, scale_inv.to(torch.float8_e8m0fnu) if ue8m0 else scale_inv


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


def quantized_tensors(hf_name: str, value: Tensor, routed_expert: bool, v4: bool = False,
                      modules_to_not_convert: list[str] | None = None) -> list[tuple[str, Tensor]]:
    """The tensors ``--hf-fp8`` writes for one HF tensor: itself (``stored_in_fp8`` says no), e4m3 blocks and their
    fp32 ``X.weight_scale_inv`` (DeepSeek-V3's form), or with ``v4`` DeepSeek-V4's published form: e4m3 blocks with
    a float8_e8m0fnu ``X.scale`` and, for a routed expert's weight, packed FP4 with its ``X.scale``."""
    block = tuple(HUB_CONFIG["weight_block_size"])
    scale_name = hf_name[: -len(".weight")] + V4_SCALE_SUFFIX if v4 else hf_name + SCALE_SUFFIX
    if v4 and routed_expert:
        q, s = quantize_fp4(value)
    elif stored_in_fp8(hf_name, value, modules_to_not_convert):
        q, s = quantize_block(value, block, ue8m0=v4)
    else:
        return [(hf_name, value)]
    return [(hf_name, q), (scale_name, s)]


_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", E4M3: "F8_E4M3",
                torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8", torch.uint8: "U8", torch.float4_e2m1fn_x2: "F4"}


def _stored_dtype(reader: Any, name: str) -> str:
    """safetensors' name of ``name``'s stored dtype (a reader over tensors in memory: from the tensor)."""
    if hasattr(reader, "dtype"):
        return reader.dtype(name)
    dtype = reader.read(name).dtype
    return _DTYPE_NAMES.get(dtype, str(dtype))


def _full_box(box: tuple[slice, ...] | None, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """``box`` with a whole slice for each dim it leaves out (None: the whole tensor)."""
    box = tuple(box or ())
    return box + tuple(slice(0, n) for n in shape[len(box):])


class Fp8BlockReader:
    """A ``TensorReader`` whose block-quantised tensors (FP8 blocks; DeepSeek-V4's packed FP4 experts) read
    dequantised (fp32) with their logical shapes, and whose scale partners (``X.weight_scale_inv``, or V4's
    ``X.scale``) are folded into them (module docstring). Construction reads headers only; a partner of the wrong
    shape or dtype, or FP4 weights under ``expert_dtype="fp8"``, fail there in one line naming the tensor."""

    def __init__(self, reader: Any, fmt: QuantFormat | tuple[int, int]) -> None:
        fmt = fmt if isinstance(fmt, QuantFormat) else QuantFormat(tuple(fmt))
        self.reader, self.format, self.block, self.root = reader, fmt, fmt.block, reader.root
        names = set(reader.names())
        self._scale: dict[str, str] = {}   # weight name -> its scale's name
        self._fp4: set[str] = set()
        for n in sorted(names):
            if n.endswith(SCALE_SUFFIX):
                weight = n[: -len(SCALE_SUFFIX)]
                if weight not in names:
                    raise ValueError(f"{reader.root}: {n} has no tensor {weight!r} to scale")
            elif n.endswith(V4_SCALE_SUFFIX) and (weight := n[: -len(V4_SCALE_SUFFIX)] + ".weight") in names \
                    and _stored_dtype(reader, weight) in FP8_DTYPES + PACKED_DTYPES:
                pass
            else:
                continue
            if weight in self._scale:
                raise ValueError(f"{reader.root}: {weight!r} has two scales, {self._scale[weight]!r} and {n!r}")
            self._scale[weight] = n
            self._check(weight, n)
        self._scales = set(self._scale.values())

    def _check(self, weight: str, scale: str) -> None:
        reader = self.reader
        scale_dtype = _stored_dtype(reader, scale)
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"{reader.root}: scale {scale!r} is stored as {scale_dtype}; moefold reads scales "
                             f"stored as {', '.join(SCALE_DTYPES)}")
        if _stored_dtype(reader, weight) not in PACKED_DTYPES:
            return
        if self.format.expert_dtype is not ExpertDtype.FP4:
            raise ValueError(f"{reader.root}: {weight!r} is packed FP4 ({_stored_dtype(reader, weight)}) but "
                             "quantization_config has expert_dtype='fp8' (DeepSeek-V4 checkpoints say "
                             "expert_dtype='fp4')")
        check_fp4_shapes(f"{reader.root}: {weight}", reader.shape(weight), reader.shape(scale))
        self._fp4.add(weight)

    def __contains__(self, name: str) -> bool:
        return name in self.reader and name not in self._scales

    def names(self) -> list[str]:
        return [n for n in self.reader.names() if n in self]

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical shape: a packed FP4 weight's last dim is twice its bytes'."""
        shape = self.reader.shape(name)
        return (*shape[:-1], 2 * shape[-1]) if name in self._fp4 else shape

    def is_fp8(self, name: str) -> bool:
        """Whether ``name`` is stored quantised (FP8 blocks or, ``is_fp4``, packed FP4) and read dequantised."""
        return name in self._scale

    def is_fp4(self, name: str) -> bool:
        return name in self._fp4

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> Tensor:
        if name not in self._scale:
            return self.reader.read(name, box)
        shape = self.shape(name)
        box = _full_box(box, shape)
        if name in self._fp4:
            packed_box, scale_box, k0, k_len = fp4_read_boxes(box, shape[-1])
            return dequantize_fp4(self.reader.read(name, packed_box), self.reader.read(self._scale[name], scale_box),
                                  k0, k_len)
        q = self.reader.read(name, box)
        scale_box = tuple(box[:-2]) + tuple(
            slice((sl.start or 0) // b, -(-(sl.stop if sl.stop is not None else n) // b))
            for sl, b, n in zip(box[-2:], self.block, shape[-2:]))
        s = self.reader.read(self._scale[name], scale_box)
        return dequantize_block(q, s, self.block, box, shape)

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> Fp8BlockReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fp8_reader(reader: Any, hf_config: dict[str, Any] | None) -> Any:
    """``reader`` itself for an unquantised checkpoint, an ``Fp8BlockReader`` over it for a quantised one."""
    if isinstance(reader, Fp8BlockReader):
        return reader
    fmt = quant_format(hf_config)
    return reader if fmt is None else Fp8BlockReader(reader, fmt)


__all__ = ["HUB_CONFIG", "V4_CONFIG", "ExpertDtype", "Fp8BlockReader", "QuantFormat", "ScaleFormat", "block_size",
           "dequantize_block", "fp8_reader", "quant_format", "quantize_block", "quantized_tensors", "stored_in_fp8"]
