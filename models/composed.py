"""``composed``: a frozen dataclass made of section dataclasses that still takes and reads its flat names.

    @composed
    @dataclass(frozen=True)
    class TrainConfig:
        seed: int = 1234
        optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
        schedule: ScheduleConfig = field(default_factory=ScheduleConfig)

    TrainConfig(lr=1e-3, seed=7)                  # flat names go to their section: optimizer=OptimizerConfig(lr=1e-3)
    TrainConfig(optimizer=OptimizerConfig(lr=1e-3))  # the nested form
    t.lr == t.optimizer.lr; TrainConfig.lr == the default; dataclasses.replace(t, lr=2e-3) keeps the other sections

Each value is checked once, by the section that owns it (its ``__post_init__``); the composite checks only what
spans sections. A section is a field whose ``default_factory`` is a dataclass; every field of every section is a
flat name of the composite (names must not clash). A field's flat name is its own name, or the one its metadata
gives (``field(..., metadata={"flat": "moe_topk"})`` on a section's field ``topk``). A section that is itself
``composed`` lends its flat names, so sections nest (``ModelConfig.moe.router.topk`` is ``moe_topk``). ``aliases``
adds flat names that are not a field's (an earlier flat field kept for its readers): ``{flat: (section, field,
to_field, from_field)}``, where the two functions convert a flat value to the section's and back;
``field`` may be a dotted path into the section (``"flex.num_sms"``: the section's field ``flex``, itself a
dataclass). A section's default is its field's ``default_factory()`` (a function may return the section's
dataclass). ``flat_dict()`` is the flat form (what earlier moefold saved, and what readers of a saved config's
flat keys expect); the constructor reads either form (sections given as mappings: JSON / YAML), or a mix, the
flat names winning.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import Any

Alias = tuple[str, str, Callable[[Any], Any], Callable[[Any], Any]]


def _same(value: Any) -> Any:
    return value


class _Flat:
    """A flat name on the composite: its section's value on an instance (``section`` None: the composite's own field
    ``name``), the default on the class.

    Read once per use by every consumer of a config (the planner reads millions a search), so the whole path is
    resolved here: a nested composite's flat name becomes the dotted path to its field (``moe_topk`` on a model
    config: ``moe.router.topk``), read by one ``operator.attrgetter`` instead of a descriptor per level."""

    def __init__(self, section: str | None, name: str, default: Any, read: Callable[[Any], Any] = _same,
                 kind: type | None = None) -> None:
        inner = vars(kind).get(name) if kind is not None else None
        if isinstance(inner, _Flat):   # the section is composed and ``name`` one of its flat names
            name, read = inner.path, _then(inner.read, read)
        self.path = name if section is None else f"{section}.{name}"
        self.default, self.read = default, read
        self._value = operator.attrgetter(self.path)

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self.default
        return self._value(obj) if self.read is _same else self.read(self._value(obj))


def _then(first: Callable[[Any], Any], second: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``second(first(x))``, ``_same`` dropped."""
    if first is _same or second is _same:
        return second if first is _same else first
    return lambda value: second(first(value))


def _get(holder: Any, path: str) -> Any:
    """``holder``'s value at the dotted ``path``."""
    for name in path.split("."):
        holder = getattr(holder, name)
    return holder


def _nest(values: dict[str, Any]) -> dict[str, Any]:
    """``{"flex.num_sms": 8, "kind": k}`` -> ``{"flex": {"num_sms": 8}, "kind": k}``."""
    out: dict[str, Any] = {}
    for path, value in values.items():
        *parents, name = path.split(".")
        holder = out
        for parent in parents:
            holder = holder.setdefault(parent, {})
        holder[name] = value
    return out


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for name, value in changes.items():
        out[name] = _merge(out[name], value) if isinstance(value, dict) and isinstance(out.get(name), dict) else value
    return out


def _replace(obj: Any, values: dict[str, Any]) -> Any:
    """``obj`` with ``values`` (nested mappings: the dataclass-valued fields' own values, JSON / YAML's form)."""
    changes = {name: _replace(getattr(obj, name), value)
               if isinstance(value, dict) and dataclasses.is_dataclass(getattr(obj, name)) else value
               for name, value in values.items()}
    return dataclasses.replace(obj, **changes)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def flat_name(f: dataclasses.Field) -> str:
    """The flat name of field ``f``: its metadata's ``flat``, else its name."""
    return f.metadata.get("flat", f.name)


def section_names(kind: type) -> dict[str, str]:
    """{flat name: the attribute of a ``kind`` instance that holds it} of a section's values."""
    if hasattr(kind, "FLAT_NAMES"):   # itself composed: its flat names, read through its own descriptors
        return {name: name for name in kind.FLAT_NAMES}
    return {flat_name(f): f.name for f in dataclasses.fields(kind)}


def composed(cls: type | None = None, *, sections: tuple[str, ...] | None = None,
             aliases: dict[str, Alias] | None = None) -> Any:
    """Make the frozen dataclass ``cls`` take and read its sections' fields by their flat names (module docstring).
    ``sections``: the fields whose fields become flat names (None: every dataclass-valued field)."""
    if cls is None:
        return functools.partial(composed, sections=sections, aliases=aliases)
    aliases = dict(aliases or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    factories = {name: f.default_factory for name, f in fields.items() if f.default_factory is not dataclasses.MISSING}
    kinds = {name: make if isinstance(make, type) else type(make()) for name, make in factories.items()
             if dataclasses.is_dataclass(make) or dataclasses.is_dataclass(make())}
    nested = {name: kinds[name] for name in (kinds if sections is None else sections)}
    sections = {name: kinds[name] for name in {**nested, **{a[0]: None for a in aliases.values()}}}
    flat: dict[str, tuple[str | None, str, Callable[[Any], Any]]] = {}   # flat name -> (section, field, to_field)
    own = {flat_name(f) for name, f in fields.items() if name not in nested}

    def lift(name: str, section: str | None, attribute: str, default: Any) -> None:
        if name in flat or (section is not None and (name in own or name in fields)):
            raise TypeError(f"{cls.__name__}: the flat name {name!r} of section {section!r} clashes")
        flat[name] = (section, attribute, _same)
        setattr(cls, name, _Flat(section, attribute, default, kind=None if section is None else nested[section]))

    for name, f in fields.items():   # the composite's own fields that go by another flat name
        if name not in nested and flat_name(f) != name:
            lift(flat_name(f), None, name, _default(f))
    for section, kind in nested.items():
        defaults = {f.name: f for f in dataclasses.fields(kind)}
        for name, attribute in section_names(kind).items():
            lift(name, section, attribute,
                 getattr(kind, name) if hasattr(kind, "FLAT_NAMES") else _default(defaults[attribute]))
    def build(section: str, values: dict[str, Any]) -> Any:
        # a section class takes its values (the required ones among them); a factory function gives the default
        # that the values change, nested mappings included
        make = factories[section]
        return make(**values) if isinstance(make, type) else _replace(make(), values)

    for name, (section, field, to_field, from_field) in aliases.items():
        make = factories[section]
        default = from_field(_get(make(), field) if "." in field or not isinstance(make, type) else
                             _default(next(f for f in dataclasses.fields(make) if f.name == field)))
        flat[name] = (section, field, to_field)
        setattr(cls, name, _Flat(section, field, default, from_field, kind=kinds.get(section)))
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kw: Any) -> None:
        changes: dict[str, dict[str, Any]] = {}
        for name in [k for k in kw if k in flat]:
            section, field, to_field = flat[name]
            if section is None:
                kw[field] = to_field(kw.pop(name))
            else:
                changes.setdefault(section, {})[field] = to_field(kw.pop(name))
        for section, values in changes.items():
            given, values = kw.get(section), _nest(values)
            if isinstance(given, dict):
                kw[section] = _merge(given, values)
            else:
                kw[section] = build(section, values) if given is None else _replace(given, values)
        for section in sections:
            if isinstance(kw.get(section), dict):   # the nested form, read back from JSON / YAML
                kw[section] = build(section, kw[section])
        init(self, *args, **kw)

    cls.__init__ = __init__
    cls.SECTIONS = dict(nested)
    cls.FLAT_NAMES = tuple(flat_name(f) for name, f in fields.items() if name not in nested) + \
        tuple(name for name in flat if flat[name][0] is not None)   # every value's flat name
    cls.flat_dict = _flat_dict
    return cls


def _flat_dict(self: Any) -> dict[str, Any]:
    """Every value by its flat name (the composite's own fields, then each section's fields; aliases left out)."""
    out = {flat_name(f): getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self.SECTIONS}
    for section in self.SECTIONS:
        value = getattr(self, section)
        if hasattr(value, "flat_dict"):
            out.update(value.flat_dict())
            continue
        out.update({flat_name(f): getattr(value, f.name) for f in dataclasses.fields(value)})
    return out


__all__ = ["composed", "flat_name", "section_names"]
