"""A published multimodal HF directory read as its text model.

Qwen3.5-MoE is published as ``Qwen3_5MoeForConditionalGeneration``: ``config.json`` nests the language model's
config under ``text_config`` (``model_type: qwen3_5_moe_text``, what ``Qwen3_5MoeForCausalLM`` reads) beside a
``vision_config``, and the safetensors hold ``model.language_model.*`` (the text decoder), ``lm_head.*``,
``model.visual.*`` (the vision tower) and, in the published files, ``mtp.*``. moefold trains the text model:

- ``text_config(hf)``: the nested text config, with the top level's ``tie_word_embeddings`` (the field
  ``Qwen3_5MoeForConditionalGeneration`` ties its head by); a nested value that disagrees is refused in one line;
- ``TextModelReader``: the directory's tensors under the text model's names (``model.language_model.X`` read as
  ``model.X``), the vision tower's left out (listed by ``skipped``), everything else as stored.

An export writes the text model (``Qwen3_5MoeForCausalLM``, ``qwen3_5_moe_text``), which transformers loads with
``AutoModelForCausalLM``; the vision tower is not carried along.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

# architectures whose directory is read as its text model: {architecture: (text prefix, vision prefix)}
TEXT_OF = {"Qwen3_5MoeForConditionalGeneration": ("model.language_model.", "model.visual.")}


def is_multimodal(hf: dict[str, Any]) -> bool:
    """Whether ``hf`` (a parsed config.json) is one of ``TEXT_OF``'s architectures."""
    return "text_config" in hf and any(a in TEXT_OF for a in hf.get("architectures") or ())


def _prefixes(hf: dict[str, Any]) -> tuple[str, str]:
    return next(TEXT_OF[a] for a in hf["architectures"] if a in TEXT_OF)


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a multimodal config.json (``hf`` itself for any other)."""
    if not is_multimodal(hf):
        return hf
    text = hf["text_config"]
    if not isinstance(text, dict):
        raise ValueError(f"text_config must be a mapping of the text model's fields, not {type(text).__name__}")
    tie = bool(hf.get("tie_word_embeddings", False))
    if "tie_word_embeddings" in text and bool(text["tie_word_embeddings"]) != tie:
        raise ValueError(f"text_config.tie_word_embeddings={text['tie_word_embeddings']!r} disagrees with the top "
                         f"level's {tie!r}, which {hf['architectures'][0]} ties its head by")
    return {**text, "tie_word_embeddings": tie}


class TextModelReader:
    """``reader``'s tensors named as the text model's (``TensorReader``'s interface): ``text_prefix + X`` as
    ``model.X``; names under ``vision_prefix`` hidden (``skipped``); the rest unchanged."""

    def __init__(self, reader: Any, text_prefix: str, vision_prefix: str) -> None:
        self.inner, self.root = reader, reader.root
        self._stored: dict[str, str] = {}
        self.skipped: list[str] = []
        for name in reader.names():
            if name.startswith(vision_prefix):
                self.skipped.append(name)
            else:
                own = "model." + name[len(text_prefix):] if name.startswith(text_prefix) else name
                if own in self._stored:
                    raise ValueError(f"{reader.root}: tensor {name!r} and {self._stored[own]!r} both name the text "
                                     f"model's {own!r}")
                self._stored[own] = name
        self.weight_map = {own: reader.weight_map[name] for own, name in self._stored.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._stored

    def names(self) -> list[str]:
        return list(self._stored)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(self._stored[name])

    def dtype(self, name: str) -> str:
        return self.inner.dtype(self._stored[name])

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> Tensor:
        if name not in self._stored:
            raise KeyError(name)
        return self.inner.read(self._stored[name], box)

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> TextModelReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def text_reader(reader: Any, hf: dict[str, Any]) -> Any:
    """``reader`` itself, or a ``TextModelReader`` over it when ``hf`` (the directory's raw config.json) is
    multimodal."""
    return TextModelReader(reader, *_prefixes(hf)) if is_multimodal(hf) else reader


__all__ = ["TEXT_OF", "TextModelReader", "is_multimodal", "text_config", "text_reader"]
