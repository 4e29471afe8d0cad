"""Which torch names moefold uses, and how: ``used_names`` reads moefold's sources (the AST, not a grep) for every
dotted name reached from a torch import (``torch.nn.functional.grouped_mm``, ``dist.all_to_all_single`` ->
``torch.distributed.all_to_all_single``, ``from torch.utils.checkpoint import checkpoint``, ``aten =
torch.ops.aten`` then ``aten._flash_attention_forward``) and how moefold calls it (keywords, number of positional
arguments). Attributes of values (``x.view(...)``, ``p.grad``) are not names and are not counted.
``tools.gpu.torch_api`` checks them against a torch release.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]   # the checkout (tools/gpu/ is two folders down)
FOLDERS = ("parallel", "precision", "dense", "moe", "dispatch", "models", "execution", "pipeline", "training",
           "planner", "tools")


@dataclass
class Use:
    """How moefold uses one torch name: the keywords it passes, the positional counts of its calls, where."""

    keywords: set[str] = field(default_factory=set)
    positional: set[int] = field(default_factory=set)
    where: set[str] = field(default_factory=set)


def used_names(root: Path = REPO, folders: tuple[str, ...] = FOLDERS) -> dict[str, Use]:
    """{dotted torch name moefold reaches: how it uses it} over ``root/folder/**.py``."""
    out: dict[str, Use] = defaultdict(Use)
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            _scan(ast.parse(path.read_text(encoding="utf-8"), str(path)), out, str(path.relative_to(root)))
    return dict(out)


def _scan(tree: ast.Module, out: dict[str, Use], where: str) -> None:
    alias: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    alias[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                if a.name != "*":
                    alias[a.asname or a.name] = f"{node.module}.{a.name}"
                    out[f"{node.module}.{a.name}"].where.add(where)

    def dotted(node: ast.AST) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in alias:
            return ".".join([alias[node.id], *reversed(parts)])
        return None

    for stmt in tree.body:   # module-level ``aten = torch.ops.aten``: a name for a torch name
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
                and (name := dotted(stmt.value)) is not None:
            alias[stmt.targets[0].id] = name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (name := dotted(node)) is not None:
            out[name].where.add(where)
        elif isinstance(node, ast.Call) and (name := dotted(node.func) if isinstance(node.func, ast.Attribute) else
                                             (alias.get(node.func.id) if isinstance(node.func, ast.Name) else None)):
            use = out[name]
            use.where.add(where)
            use.keywords.update(k.arg for k in node.keywords if k.arg is not None)
            if not any(isinstance(a, ast.Starred) for a in node.args):
                use.positional.add(len(node.args))
