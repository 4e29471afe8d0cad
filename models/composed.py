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
flat name of the composite (names must not clash). ``aliases`` adds flat names that differ from the section's own
(an earlier flat field kept for its readers): ``{flat: (section, field, to_field, from_field)}``, where the two
functions convert a flat value to the section's and back. ``flat_dict()`` is the flat form (what earlier moefold
saved, and what readers of a saved config's flat keys expect); the constructor reads either form (sections given as
mappings: JSON / YAML), or a mix, the flat names winning.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

Alias = tuple[str, str, Callable[[Any], Any], Callable[[Any], Any]]


class _Flat:
    """A flat name on the composite: its section's value on an instance, the default on the class."""

    def __init__(self, section: str, name: str, default: Any, read: Callable[[Any], Any] = lambda v: v) -> None:
        self.section, self.name, self.default, self.read = section, name, default, read

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self.default
        return self.read(getattr(obj.__dict__[self.section], self.name))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def composed(cls: type | None = None, *, sections: tuple[str, ...] | None = None,
             aliases: dict[str, Alias] | None = None) -> Any:
    """Make the frozen dataclass ``cls`` take and read its sections' fields by their flat names (module docstring).
    ``sections``: the fields whose fields become flat names (None: every dataclass-valued field)."""
    if cls is None:
        return functools.partial(composed, sections=sections, aliases=aliases)
    aliases = dict(aliases or {})
    kinds = {f.name: f.default_factory for f in dataclasses.fields(cls) if dataclasses.is_dataclass(f.default_factory)}
    nested = {name: kinds[name] for name in (kinds if sections is None else sections)}
    sections = {name: kinds[name] for name in {**nested, **{a[0]: None for a in aliases.values()}}}
    flat: dict[str, tuple[str, str, Callable[[Any], Any]]] = {}   # flat name -> (section, field, to_field)
    own = {f.name for f in dataclasses.fields(cls)}
    for section, kind in nested.items():
        for f in dataclasses.fields(kind):
            if f.name in own or f.name in flat:
                raise TypeError(f"{cls.__name__}: the flat name {f.name!r} of section {section!r} clashes")
            flat[f.name] = (section, f.name, lambda v: v)
            setattr(cls, f.name, _Flat(section, f.name, _default(f)))
    for name, (section, field, to_field, from_field) in aliases.items():
        default = from_field(_default(next(f for f in dataclasses.fields(sections[section]) if f.name == field)))
        flat[name] = (section, field, to_field)
        setattr(cls, name, _Flat(section, field, default, from_field))
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kw: Any) -> None:
        changes: dict[str, dict[str, Any]] = {}
        for name in [k for k in kw if k in flat]:
            section, field, to_field = flat[name]
            changes.setdefault(section, {})[field] = to_field(kw.pop(name))
        for section, values in changes.items():
            given = kw.get(section)
            if isinstance(given, dict):
                kw[section] = {**given, **values}
            elif given is None:
                kw[section] = sections[section](**values)
            else:
                kw[section] = dataclasses.replace(given, **values)
        for section, kind in sections.items():
            if isinstance(kw.get(section), dict):   # the nested form, read back from JSON / YAML
                kw[section] = kind(**kw[section])
        init(self, *args, **kw)

    cls.__init__ = __init__
    cls.SECTIONS = dict(nested)
    cls.FLAT_NAMES = tuple(name for name in own if name not in nested) + tuple(flat)   # every value's flat name
    cls.flat_dict = _flat_dict
    return cls


def _flat_dict(self: Any) -> dict[str, Any]:
    """Every value by its flat name (the composite's own fields, then each section's fields; aliases left out)."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self.SECTIONS}
    for section in self.SECTIONS:
        out.update({f.name: getattr(getattr(self, section), f.name)
                    for f in dataclasses.fields(getattr(self, section))})
    return out


__all__ = ["composed"]
