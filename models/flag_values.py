"""The values of the model flags whose text is not a plain number (Megatron-LM's syntax), read without argparse.

Each raises ValueError naming the text and what is valid; ``training.cli.model_flags`` gives them to argparse.
"""

from __future__ import annotations

import ast
from typing import Any

NONE = "none"   # a flag given as "none" (an unset flag is None)


def layer_pattern(text: str | int) -> int | tuple[int, ...]:
    """Megatron's ``moe_freq_type``: ``"4"`` -> 4, ``"([0]*3+[1]*5)"`` -> (0, 0, 0, 1, 1, 1, 1, 1).

    The pattern is a list expression of 0/1 integers with ``+``, ``*`` and parentheses, evaluated without
    ``eval``."""
    if isinstance(text, int):
        return text
    text = str(text).strip()
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{text!r} is neither an int nor a pattern like ([0]*3+[1]*58)") from None

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(ast.dump(node))

    try:
        result = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        result = None
    if not isinstance(result, list) or not result or any(v not in (0, 1) for v in result):
        raise ValueError(f"{text!r} is not a pattern of 0/1 layers like ([0]*3+[1]*58)")
    return tuple(result)


def window(text: str) -> int:
    """``--window-size``: ``"4096"`` (HF sliding_window) or Megatron's ``"4095,0"`` / ``"(4095,0)"`` -> 4096."""
    parts = [p for p in str(text).strip("() ").split(",") if p.strip()]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) == 1 and values[0] >= 1:
        return values[0]
    if len(values) == 2 and values[0] >= 0 and values[1] == 0:
        return values[0] + 1
    raise ValueError(f"{text!r}: give the window N (keys a query sees, itself included) or Megatron's (left, 0)")


def int_or_none(text: str) -> int | str:
    return NONE if text.lower() == NONE else int(text)


def softmax_type(text: str) -> bool:
    """``--softmax-type``: vanilla, or learnable (attention sinks)."""
    if text not in ("vanilla", "learnable"):
        raise ValueError(f"--softmax-type {text!r}; valid: vanilla, learnable (Megatron's off-by-one is not "
                         "implemented)")
    return text == "learnable"


def skip_freq_pattern(num_layers: int, every: int) -> tuple[int, ...]:
    """``--window-attn-skip-freq N``: every N-th layer (1-based, Megatron's count) full attention (0), the others
    windowed (1)."""
    return tuple(int((i + 1) % every != 0) for i in range(num_layers))


__all__ = ["NONE", "int_or_none", "layer_pattern", "skip_freq_pattern", "softmax_type", "window"]
