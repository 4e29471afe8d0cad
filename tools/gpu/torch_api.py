"""Every torch API moefold calls, checked against a torch release: the running one, or another one's sources.

    python -m moefold.tools.gpu.torch_api                        # against the torch this Python imports
    python -m moefold.tools.gpu.torch_api --torch-src DIR        # against an unpacked torch wheel (DIR/torch/...)

``tools.gpu.torch_uses.used_names`` reads moefold's sources for every torch name it reaches and how it calls it
(keywords, number of positional arguments); attributes of values (``x.view(...)``, ``p.grad``) are not checked.

- Against the running torch: each name must resolve (import + getattr) and a Python callable must accept the
  keywords moefold passes (``inspect.signature``). This is what the GPU check runs first on a GPU machine, whose
  torch may be older than this machine's.
- Against another release's sources (``--torch-src``, e.g. ``pip download torch==2.11.0 --no-deps`` unpacked):
  the running torch says where each name is defined (a Python module, or a C extension); the other release's
  file must define it there (module-level definitions, imports and ``from ... import *``, class members; C
  functions and classes in its ``torch/_C/*.pyi`` stubs), and accept the same keywords. ATen operators
  (``torch.ops.aten.NAME``, private ones like ``_flash_attention_forward`` included) are checked against the
  release's ``torchgen/packaged/ATen/native/native_functions.yaml``: the operator (and overload) exists and one
  of its schemas takes moefold's positional count and keywords. Static: a name torch creates at run time in a
  way the stubs do not show is reported as unresolved, never passed silently.

Exit code: 0 when every name resolves, 1 otherwise (each problem on its own line).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import sys
import types
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moefold.tools.gpu.torch_uses import Use, used_names


@dataclass(frozen=True)
class Problem:
    name: str
    what: str

    def __str__(self) -> str:
        return f"{self.name}: {self.what}"


def _resolve(name: str) -> tuple[Any, list[tuple[str, Any]]]:
    """(object, [(dotted prefix, object)...]) for ``name`` in the running torch; AttributeError/ImportError."""
    parts = name.split(".")
    obj: Any = importlib.import_module(parts[0])
    chain = [(parts[0], obj)]
    for i, part in enumerate(parts[1:], start=1):
        prefix = ".".join(parts[: i + 1])
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(prefix)   # a submodule not imported by its parent
        chain.append((prefix, obj))
    return obj, chain


def _accepts(fn: Any, keywords: set[str]) -> set[str]:
    """The keywords ``fn``'s Python signature does not take (empty when it takes **kwargs or has no signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return set()
    return keywords - {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def check_running(names: dict[str, Use]) -> list[Problem]:
    """Every name resolves in the torch this interpreter imports, and takes the keywords moefold passes (ATen
    operators: one of their schemas takes moefold's positional count and keywords)."""
    import torch

    problems = []
    for name in sorted(names):
        try:
            obj, _ = _resolve(name)
        except (AttributeError, ImportError, RuntimeError) as err:
            problems.append(Problem(name, f"missing ({type(err).__name__}: {err})"))
            continue
        if isinstance(obj, torch._ops.OpOverloadPacket):
            schemas = [_Schema.parse(str(getattr(obj, ov)._schema).split("::", 1)[-1]) for ov in obj.overloads()]
            if (why := _schemas_reject(schemas, names[name])) is not None:
                problems.append(Problem(name, why))
        elif callable(obj) and (bad := _accepts(obj, names[name].keywords)):
            problems.append(Problem(name, f"takes no keyword {', '.join(sorted(bad))}"))
    return problems


@dataclass(frozen=True)
class _Schema:
    """An ATen schema's arguments: positional (name, has a default) and keyword-only names."""

    positional: tuple[tuple[str, bool], ...]
    keyword_only: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> _Schema:
        """``name.overload(Type a, Type b=1, *, Type c=None) -> Ret``."""
        args = text[text.index("(") + 1: text.rindex(") ->")] if ") ->" in text else text[text.index("(") + 1:-1]
        parts, depth, cur = [], 0, ""
        for ch in args:
            depth += (ch in "([" and 1) or (ch in ")]" and -1) or 0
            if ch == "," and depth == 0:
                parts.append(cur.strip())
                cur = ""
            else:
                cur += ch
        if cur.strip():
            parts.append(cur.strip())
        positional, keyword_only, kw = [], [], False
        for part in parts:
            if part == "*":
                kw = True
                continue
            decl, _, default = part.partition("=")
            arg = decl.split()[-1]
            (keyword_only.append(arg) if kw else positional.append((arg, bool(default))))
        return cls(tuple(positional), tuple(keyword_only))

    def takes(self, use: Use) -> bool:
        names = {n for n, _ in self.positional} | set(self.keyword_only)
        required = sum(not d for _, d in self.positional)
        return use.keywords <= names and all(
            required <= n + len(use.keywords & {a for a, _ in self.positional}) and n <= len(self.positional)
            for n in use.positional)


def _schemas_reject(schemas: list[_Schema], use: Use) -> str | None:
    if any(s.takes(use) for s in schemas):
        return None
    return (f"no schema takes {sorted(use.positional)} positional argument(s) and keywords "
            f"{sorted(use.keywords)} ({len(schemas)} overload(s))")


# ------------------------------------------------------------------------------ another release's sources
class SourceTree:
    """Module-level names (and class members) of an unpacked torch, read statically."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._defs: dict[Path, dict[str, ast.AST | None]] = {}
        self._stubs: list[Path] | None = None

    def module_file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py", base.with_suffix(".pyi"),
                          base / "__init__.pyi"):
            if candidate.is_file():
                return candidate
        return None

    def is_package_dir(self, module: str) -> bool:
        return self.root.joinpath(*module.split(".")).is_dir()

    def definitions(self, path: Path, seen: frozenset[Path] = frozenset()) -> dict[str, ast.AST | None]:
        """{name: its def/class node (None for other bindings)} at module level of ``path``."""
        if path in self._defs:
            return self._defs[path]
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"), str(path))
        defs: dict[str, ast.AST | None] = {}
        module = ".".join(path.relative_to(self.root).with_suffix("").parts).removesuffix(".__init__")
        self._collect(tree.body, defs, module, path.name.startswith("__init__"), seen | {path})
        self._defs[path] = defs
        return defs

    def _collect(self, body: list[ast.stmt], defs: dict, module: str, is_pkg: bool, seen: frozenset[Path]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and isinstance(defs.get(node.name), Overloads):
                defs[node.name].defs.append(node)   # typing.overload: every signature counts
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs[node.name] = Overloads([node])
            elif isinstance(node, ast.ClassDef):
                defs[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            defs.setdefault(n.id, None)
                    if isinstance(t, ast.Name) and t.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                        for elt in node.value.elts:
                            if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                                defs.setdefault(elt.value, None)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    defs.setdefault(a.asname or a.name.split(".")[0], None)
            elif isinstance(node, ast.ImportFrom):
                source = self._absolute(node, module, is_pkg)
                for a in node.names:
                    if a.name == "*" and source and not source.startswith("torch"):
                        defs.setdefault(f"*{source}", None)   # torch.multiprocessing: from multiprocessing import *
                    elif a.name == "*":
                        path = self.module_file(source) if source else None
                        if path is not None and path not in seen:
                            defs.update({k: v for k, v in self.definitions(path, seen).items()
                                         if not k.startswith("_")})
                    else:
                        found = None
                        path = self.module_file(source) if source else None
                        if path is not None and path not in seen:
                            found = self.definitions(path, seen).get(a.name)
                        defs.setdefault(a.asname or a.name, found)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for block in ("body", "orelse", "finalbody"):
                    self._collect(getattr(node, block, []) or [], defs, module, is_pkg, seen)
                for handler in getattr(node, "handlers", []):
                    self._collect(handler.body, defs, module, is_pkg, seen)

    @staticmethod
    def _absolute(node: ast.ImportFrom, module: str, is_pkg: bool) -> str | None:
        if node.level == 0:
            return node.module
        parts = module.split(".")
        base = parts if is_pkg else parts[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join([*base, node.module] if node.module else base) or None

    def stubs(self) -> list[Path]:
        if self._stubs is None:
            self._stubs = sorted((self.root / "torch" / "_C").rglob("*.pyi"))
        return self._stubs

    def stub_definition(self, name: str) -> ast.AST | bool | None:
        """The def/class of ``name`` in any torch/_C stub (True for another binding), else False."""
        for stub in self.stubs():
            defs = self.definitions(stub)
            if name in defs:
                return defs[name] if defs[name] is not None else True
        return False


@dataclass
class Overloads(ast.AST):
    """Every ``def`` of one name in one module (``typing.overload`` stubs have several)."""

    defs: list[ast.FunctionDef | ast.AsyncFunctionDef]


def _members(node: ast.AST | None) -> set[str] | None:
    """The names a class body binds (methods, assignments, nested classes); None when ``node`` is no class."""
    if not isinstance(node, ast.ClassDef):
        return None
    names = set()
    for stmt in ast.walk(node):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt is not node:
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            for t in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _params(node: ast.AST | None) -> set[str] | None:
    """Keyword-passable parameters of a def (None: unknown or takes **kwargs); a class: its __init__'s."""
    if isinstance(node, ast.ClassDef):
        init = next((s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
        return _params(init) if init is not None else None
    if isinstance(node, Overloads):
        each = [_params(d) for d in node.defs]
        return None if any(p is None for p in each) else set().union(*each)
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.args.kwarg is not None:
        return None
    a = node.args
    return {p.arg for p in [*a.args, *a.kwonlyargs]}


def _is_file_module(obj: Any) -> bool:
    """A module with a source file (``torch.ops`` and its namespaces are ModuleType objects made at run time)."""
    return isinstance(obj, types.ModuleType) and getattr(obj, "__spec__", None) is not None


NATIVE_FUNCTIONS = Path("torchgen", "packaged", "ATen", "native", "native_functions.yaml")


def native_schemas(path: Path) -> dict[str, list[_Schema]]:
    """{operator name: its overloads' schemas} from a ``native_functions.yaml``; "name.overload" keys too."""
    out: dict[str, list[_Schema]] = defaultdict(list)
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("- func: "):
            text = line[len("- func: "):]
            full = text[: text.index("(")]
            schema = _Schema.parse(text)
            out[full.split(".")[0]].append(schema)
            out[full if "." in full else f"{full}.default"].append(schema)
    return dict(out)


def _check_aten(name: str, use: Use, schemas: dict[str, list[_Schema]]) -> Problem | None:
    parts = name.split(".")[3:]   # torch.ops.aten.NAME[.OVERLOAD]
    if not parts:
        return None
    key = parts[0] if len(parts) == 1 else f"{parts[0]}.{parts[1]}"
    if key not in schemas:
        return Problem(name, f"ATen operator {key} is not in this release's native_functions.yaml")
    return Problem(name, why) if (why := _schemas_reject(schemas[key], use)) is not None else None


def check_source(names: dict[str, Use], root: Path) -> list[Problem]:
    """Every name (located in the running torch) is defined where the release under ``root`` would define it."""
    tree = SourceTree(root)
    yaml = root / NATIVE_FUNCTIONS
    aten = native_schemas(yaml) if yaml.is_file() else None
    problems = []
    for name in sorted(names):
        if name.startswith("torch.ops.aten."):
            if aten is None:
                problems.append(Problem(name, f"no {NATIVE_FUNCTIONS} under {root} to check ATen operators in"))
            elif (problem := _check_aten(name, names[name], aten)) is not None:
                problems.append(problem)
            continue
        try:
            obj, chain = _resolve(name)
        except (AttributeError, ImportError) as err:
            problems.append(Problem(name, f"not in the running torch either ({err}); cannot locate it"))
            continue
        if _is_file_module(obj):
            if tree.module_file(obj.__name__) is None and not tree.is_package_dir(obj.__name__):
                problems.append(Problem(name, f"module {obj.__name__} is missing"))
            continue
        # the last module with a file on the way in, and the attributes under it
        i = max(k for k, (_, o) in enumerate(chain) if _is_file_module(o))
        module, attrs = chain[i][1].__name__, name.split(".")[i + 1:]
        node = _lookup(tree, module, attrs[0], chain[i + 1][1])
        for attr in attrs[1:]:
            if node is False:
                break
            members = _members(node if isinstance(node, ast.AST) else None)
            if members is None:   # an attribute of something that is not a class body: not checkable statically
                node = True
                break
            if attr not in members and not _inherited(tree, node, attr):
                problems.append(Problem(name, f"{attr} is not a member of {node.name} in this release"))
                node = None
                break
            defs = [d for d in node.body if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)) and d.name == attr]
            classes = [c for c in node.body if isinstance(c, ast.ClassDef) and c.name == attr]
            node = classes[0] if classes else Overloads(defs) if defs else True
        if node is False:
            problems.append(Problem(name, f"{attrs[0]} is not defined in {module} nor in the C stubs of this release"))
            continue
        params = _params(node) if isinstance(node, ast.AST) else None
        if params is not None and (bad := names[name].keywords - params):
            problems.append(Problem(name, f"takes no keyword {', '.join(sorted(bad))} in this release"))
    return problems


def _lookup(tree: SourceTree, module: str, attr: str, obj: Any) -> ast.AST | bool | None:
    """The definition of ``module.attr`` in the other release: its module file, the module the running torch
    says defines ``obj``, a submodule, or a C stub. False when none has it."""
    defining = getattr(obj, "__module__", None)
    defining = defining if isinstance(defining, str) else ""
    candidates = [module] + ([defining] if defining.startswith("torch") and defining != module else [])
    for mod in candidates:
        path = tree.module_file(mod)
        if path is None:
            continue
        defs = tree.definitions(path)
        if attr in defs:
            found = defs[attr]
            if found is None and (stub := tree.stub_definition(attr)) not in (False, True):
                return stub   # re-bound from the C extension: its stub has the signature
            return found
        if any(k.startswith("*") and defining.startswith(k[1:]) for k in defs):
            return True   # re-exported from outside torch (from multiprocessing import *)
    if tree.module_file(f"{module}.{attr}") is not None or tree.is_package_dir(f"{module}.{attr}"):
        return True
    if module == "torch" or defining.startswith("torch._C") or inspect.isbuiltin(obj):
        return tree.stub_definition(attr)   # torch/__init__.py copies torch._C._VariableFunctions at run time
    return False


def _inherited(tree: SourceTree, node: ast.ClassDef, attr: str, depth: int = 0) -> bool:
    """``attr`` defined by a base class of ``node`` found in the same release (its module or the C stubs)."""
    if depth > 5:
        return False
    for base in node.bases:
        base_name = base.attr if isinstance(base, ast.Attribute) else base.id if isinstance(base, ast.Name) else None
        if base_name is None:
            continue
        found = tree.stub_definition(base_name)
        for path in [*(p for p in tree._defs)]:
            if base_name in tree._defs[path] and isinstance(tree._defs[path][base_name], ast.ClassDef):
                found = tree._defs[path][base_name]
                break
        members = _members(found if isinstance(found, ast.AST) else None)
        if members is not None and (attr in members or _inherited(tree, found, attr, depth + 1)):
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moefold.tools.gpu.torch_api", allow_abbrev=False,
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--torch-src", default=None,
                        help="an unpacked torch wheel (the folder holding torch/): check its sources statically "
                             "instead of the running torch")
    args = parser.parse_args(argv)
    import torch

    names = used_names()
    keywords = sum(len(v.keywords) for v in names.values())
    if args.torch_src:
        root = Path(args.torch_src)
        version = (root / "torch" / "version.py").read_text().split("__version__ = ")[-1].split("\n")[0].strip("'\"")
        problems = check_source(names, root)
        where = f"torch {version} sources in {root} (located through the running torch {torch.__version__})"
    else:
        problems = check_running(names)
        where = f"the running torch {torch.__version__}"
    print(f"{len(names)} torch names moefold uses ({keywords} keyword uses), checked against {where}: "
          f"{len(problems)} problem(s)")
    for problem in problems:
        print(f"  {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
