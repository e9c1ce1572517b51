"""A pydantic ValidationError worded for a person: one line per bad key, naming the key and the value given, with the
bounds and types its model declares (``optim.lr must be > 0, got -1``). Used by the fine-tuning config
(ibedl.training.config) and by the methods' hyper-parameters (ibedl.training.methods.base), which the config checks:
a module of its own, so neither imports the other for it."""

from __future__ import annotations

from typing import get_args

from pydantic import BaseModel, ValidationError


def _bounds(model: type[BaseModel], name: str) -> str | None:
    """'in [0, 1)', '> 0', '>= 1', ... from a field's Field(ge/gt/le/lt) bounds; None without any."""
    low = high = None
    for m in model.model_fields[name].metadata:
        for attr, kind in (("ge", "["), ("gt", "("), ("le", "]"), ("lt", ")")):
            value = getattr(m, attr, None)
            if value is not None:
                if kind in "[(":
                    low = (kind, value)
                else:
                    high = (kind, value)
    if low and high:
        return f"in {low[0]}{low[1]:g}, {high[1]:g}{high[0]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {low[1]:g}"
    if high:
        return f"{'<=' if high[0] == ']' else '<'} {high[1]:g}"
    return None


_NUMBER_ERRORS = {"finite_number", "float_type", "float_parsing", "int_type", "int_parsing", "int_from_float",
                  "greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def describe(error: ValidationError, model: type[BaseModel] | None, prefix: str = "") -> str:
    """A pydantic ValidationError as one line per bad key, naming the key (``optim.lr``, with ``prefix`` before it)
    and the value given: ``optim.lr must be > 0, got -1``. ``model``: the model that raised it (its fields' bounds and
    types word the messages; None: the errors' own words). The validators' own messages (they name key and value)
    are kept."""
    lines, seen = [], set()
    errors = error.errors()
    for e in errors:
        loc = [p for p in e["loc"] if not _is_tag(p)]  # field names and list indices
        key = prefix + ".".join(str(p) for p in loc)
        if key in seen:
            continue  # a union's alternatives each report the same bad value
        seen.add(key)
        if e["type"] == "value_error":
            lines.append(str(e["ctx"]["error"]))
            continue
        names = [p for p in loc if isinstance(p, str)]
        owner = _owner(model, names)
        field = owner.model_fields.get(names[-1]) if owner is not None and names else None
        bounds = _bounds(owner, names[-1]) if field is not None else None
        types = {x["type"] for x in errors if [p for p in x["loc"] if not _is_tag(p)] == loc}
        kind = _number_kind(field)
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown config keys [{key!r}]")
        elif kind and types <= _NUMBER_ERRORS:  # a number field: one message for its type, nan and bounds
            null = " (or null)" if field.default is None and not field.is_required() else ""
            lines.append(f"{key} must be {kind}{' ' + bounds if bounds else ''}{null}, got {e['input']!r}")
        elif e["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal") and bounds:
            lines.append(f"{key} must be {bounds}, got {e['input']!r}")
        elif e["type"] == "literal_error":
            lines.append(f"{key} must be {e['ctx']['expected']}, got {e['input']!r}")
        elif types & {"float_parsing", "float_type"}:
            lines.append(f"{key} must be a number, got {e['input']!r}")
        elif types & {"int_parsing", "int_type", "int_from_float"}:
            lines.append(f"{key} must be an integer, got {e['input']!r}")
        else:
            lines.append(f"{key}: {e['msg'][:1].lower()}{e['msg'][1:]}, got {e['input']!r}")
    return "; ".join(lines)


def _number_kind(field) -> str | None:
    """'an integer' or 'a finite number' for a field declared with ``allow_inf_nan=False`` or a strict integer (the
    methods' hyper-parameters), so one message covers a wrong type, nan and the bounds; None otherwise."""
    if field is None:
        return None
    types = {a for a in (field.annotation, *get_args(field.annotation)) if a is not type(None)}
    for a in list(types):
        types |= set(get_args(a))
    floats = float in types
    finite = any(getattr(m, "allow_inf_nan", None) is False for m in field.metadata)
    if finite and floats:
        return "a finite number"
    if finite or (field.metadata and types and all("int" in str(a).lower() for a in types)):
        return "an integer"
    return None


def _is_tag(part) -> bool:
    """A union member's or validator's tag in a pydantic error location (``int``, ``literal['center','none']``,
    ``function-before[...]``), not a key."""
    return isinstance(part, str) and (part in ("int", "float", "str", "bool", "none")
                                      or not part.replace("_", "a").isalnum())


def _owner(model: type[BaseModel] | None, loc: list[str]) -> type[BaseModel] | None:
    """The model that declares the last key of ``loc`` (a path of field names from ``model``)."""
    for part in loc[:-1]:
        if model is None or part not in model.model_fields:
            return None
        sub = model.model_fields[part].annotation
        sub = next((a for a in (sub, *get_args(sub)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if sub is None:
            args = [a for a in get_args(model.model_fields[part].annotation)]
            sub = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        model = sub
    return model


__all__ = ["describe"]
