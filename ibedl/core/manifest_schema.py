"""The JSON Schema of an artifact's manifest.json, derived from the code's one definition.

The definition is :class:`Manifest` and the dataclasses of its typed sections: field types, required fields,
enums and descriptions come from them and their docstrings.

    python -m ibedl.core.manifest_schema --output docs/reference/manifest.schema.json   (after a format change)
    python -m ibedl.core.manifest_schema --check docs/reference/manifest.schema.json    (fails when stale)

The schema states structure and types; value ranges (``min_confidence`` in [0, 1], ...) are checked by the
loader, whose messages name the bad value. It describes the current ``schema_version`` only: older manifests
are migrated when read (ibedl.core.artifact.migrate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import types
import typing
from pathlib import Path

from ibedl.core.artifact import SCHEMA_VERSION, Manifest
from ibedl.core.paths import check_writable

SCHEMA_ID = "https://ibedl.invalid/schemas/manifest.schema.json"  # a name, not a URL anything is served from
DIALECT = "https://json-schema.org/draft/2020-12/schema"

_SCALARS = {str: {"type": "string"}, bool: {"type": "boolean"}, int: {"type": "integer"}, float: {"type": "number"},
            type(None): {"type": "null"}}


def attribute_docs(cls) -> dict[str, str]:
    """Field descriptions from the ``Attributes:`` block of a Google-style class docstring (``a, b: text``
    describes both; continuation lines are joined)."""
    lines = (cls.__doc__ or "").splitlines()
    docs: dict[str, str] = {}
    names: list[str] = []
    inside, indent = False, 0
    for line in lines:
        stripped = line.strip()
        if stripped == "Attributes:":
            inside, indent = True, len(line) - len(line.lstrip())
            continue
        if not inside:
            continue
        if not stripped:
            continue
        if len(line) - len(line.lstrip()) <= indent:
            break  # the block ended
        entry = re.match(r"^([a-z_][\w]*(?:, [a-z_][\w]*)*): (.*)$", stripped)
        if entry and len(line) - len(line.lstrip()) == indent + 4:
            names = entry.group(1).split(", ")
            for name in names:
                docs[name] = entry.group(2)
        elif names:
            for name in names:
                docs[name] += " " + stripped
    return {k: plain(v) for k, v in docs.items()}


def plain(text: str) -> str:
    """Docstring markup (````code````, ``:class:`X```) as plain text, whitespace collapsed."""
    return " ".join(re.sub(r"``([^`]*)``", r"\1", re.sub(r":\w+:`([^`]*)`", r"\1", text)).split())


def type_schema(annotation) -> dict:
    """JSON Schema of a type annotation: scalars, ``X | None``, ``Literal``, ``list[X]``, ``dict[str, X]``."""
    if annotation in _SCALARS:
        return dict(_SCALARS[annotation])
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [type_schema(a) for a in args]}
    if annotation is list or origin is list:
        return {"type": "array", **({"items": type_schema(args[0])} if args else {})}
    if annotation is dict or origin is dict:
        return {"type": "object", **({"additionalProperties": type_schema(args[1])} if args else {})}
    if dataclasses.is_dataclass(annotation):
        return dataclass_schema(annotation)
    raise TypeError(f"no JSON Schema for the annotation {annotation!r}: add it to ibedl.core.manifest_schema")


def dataclass_schema(cls) -> dict:
    """An object schema of a dataclass: one property per field, fields without a default required, no other
    keys (the loaders build the dataclass from the dict, which refuses unknown keys)."""
    hints = typing.get_type_hints(cls)
    docs = attribute_docs(cls)
    properties, required = {}, []
    for f in dataclasses.fields(cls):
        section, values = f.metadata.get("section"), f.metadata.get("values")
        if section is not None:
            prop = dataclass_schema(section)
        elif values is not None:  # an object of sections by name
            prop = {"type": "object", "additionalProperties": dataclass_schema(values)}
        else:
            prop = type_schema(hints[f.name])
        if f.metadata.get("may_be_empty"):
            prop = {"anyOf": [{"type": "object", "maxProperties": 0}, prop]}
        if f.metadata.get("const"):
            prop = {**prop, "const": f.default}
        if f.name in docs:  # the field's own description (a section's class summary is the fallback)
            prop = {"description": docs[f.name], **{k: v for k, v in prop.items() if k != "description"}}
        properties[f.name] = prop
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    summary = (cls.__doc__ or cls.__name__).strip().split("\n\n")[0]
    return {"type": "object", "description": plain(summary), "properties": properties,
            "required": required, "additionalProperties": False}


def manifest_schema() -> dict:
    """The JSON Schema (draft 2020-12) of ``manifest.json`` at the current schema version."""
    title = f"ibedl artifact manifest.json, schema_version {SCHEMA_VERSION}"
    return {"$schema": DIALECT, "$id": SCHEMA_ID, "title": title, **dataclass_schema(Manifest)}


def render() -> str:
    """The schema as committed: indented JSON with a final newline."""
    return json.dumps(manifest_schema(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ibedl.core.manifest_schema", description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--output", metavar="FILE", help="write the schema to this file (default: print it)")
    what.add_argument("--check", metavar="FILE", help="exit 1 when this file differs from the schema the code defines")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        path = Path(args.check)
        if not path.is_file() or path.read_text() != text:
            print(f"{path} {'is not the schema the code defines' if path.is_file() else 'does not exist'}; "
                  f"regenerate it with: python -m ibedl.core.manifest_schema --output {path}", file=sys.stderr)
            return 1
        return 0
    if args.output:
        try:
            out = check_writable(args.output, "--output")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
