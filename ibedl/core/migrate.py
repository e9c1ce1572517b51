"""Bring artifacts to the current format without retraining; weights are read (hashed), never written.

    python -m ibedl.core.migrate artifacts/default artifacts/map artifacts/map-twin [--check]

For each artifact: the manifest is written in the current schema version (ibedl.core.artifact.migrate), the
sha256 of every weight file is recorded in its ``files`` (or checked, where recorded), each member's
``adapter_config.json`` names the base model by its portable reference (the manifest's ``base_model.ref``, not
the training machine's cache path) with PEFT's ``task_type`` ``CAUSAL_LM``, and the model card ``README.md`` is
regenerated. Running it again changes nothing; ``--check`` changes nothing and exits 1 when something would.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from ibedl.core.artifact import (
    ADAPTER_FILES,
    MANIFEST,
    PEFT_TASK_TYPE,
    SCHEMA_VERSION,
    ArtifactError,
    Manifest,
    atomic_write_text,
    check_artifact,
    files_sha256,
    manifest_json,
    read_manifest_data,
    verify_files,
)
from ibedl.core.model_card import CARD, render_card


def portable_adapter_config(config: dict, manifest: Manifest) -> dict:
    """A PEFT ``adapter_config.json`` dict naming ``manifest``'s portable base reference, task type set."""
    task_type = config.get("task_type")
    if task_type not in (None, PEFT_TASK_TYPE):
        raise ArtifactError(f"adapter_config.json has task_type {task_type!r}; an ibedl adapter sits on a causal LM "
                            f"({PEFT_TASK_TYPE}): this is not an adapter this package wrote")
    return {**config, "base_model_name_or_path": manifest.base_model_ref().ref, "task_type": PEFT_TASK_TYPE}


def planned_writes(directory: str | Path) -> tuple[dict[Path, str], list[str]]:
    """The files :func:`migrate_artifact` would write (path -> new text) and a line for each change."""
    directory = Path(directory)
    stored = read_manifest_data(directory)
    manifest = check_artifact(directory)  # migrated in memory; every member's files exist
    if manifest.files:
        verify_files(directory, manifest)
    else:
        manifest.files = files_sha256(directory, manifest.members)
    writes: dict[Path, str] = {}
    changes: list[str] = []
    text = manifest_json(manifest)
    if (directory / MANIFEST).read_text() != text:
        writes[directory / MANIFEST] = text
        recorded = "" if stored.get("files") else f"; sha256 of {len(manifest.files)} weight files recorded"
        changes.append(f"{MANIFEST}: schema_version {stored.get('schema_version')} -> {SCHEMA_VERSION}{recorded}")
    for member in manifest.members:
        path = directory / member / ADAPTER_FILES[0]
        config = json.loads(path.read_text())
        new = portable_adapter_config(config, manifest)
        if new != config:
            writes[path] = json.dumps(new, indent=2, sort_keys=True)  # as PEFT writes it
            changes += [f"{path.relative_to(directory).as_posix()}: {key} {config.get(key)!r} -> {new[key]!r}"
                        for key in ("base_model_name_or_path", "task_type") if new[key] != config.get(key)]
    card = render_card(manifest)
    if not (directory / CARD).is_file() or (directory / CARD).read_text() != card:
        writes[directory / CARD] = card
        changes.append(f"{CARD}: model card {'regenerated' if (directory / CARD).is_file() else 'written'}")
    return writes, changes


def migrate_artifact(directory: str | Path, write: bool = True) -> list[str]:
    """Migrate the artifact at ``directory`` (see the module docstring); returns what changed (or would, when
    ``write`` is False). The manifest is written last: an interrupted run is simply run again."""
    writes, changes = planned_writes(directory)
    if write:
        for path in sorted(writes, key=lambda p: p.name == MANIFEST):
            atomic_write_text(path, writes[path])
    return changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ibedl.core.migrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+", metavar="ARTIFACT", help="adapter directories (with manifest.json)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when an artifact is not in the current format")
    args = parser.parse_args(argv)
    logging.getLogger("ibedl.core.artifact").setLevel(logging.ERROR)  # its "run ibedl.core.migrate" hint, here
    report, stale = [], False
    for directory in args.artifacts:
        try:
            changes = migrate_artifact(directory, write=not args.check)
        except (ArtifactError, OSError, json.JSONDecodeError) as e:
            print(f"error: {directory}: {e}", file=sys.stderr)
            return 2
        stale |= bool(changes)
        report.append({"artifact": directory, "changes": changes})
    print(json.dumps(report, indent=2))
    if args.check and stale:
        print(f"artifacts not in the current format: run python -m ibedl.core.migrate {' '.join(args.artifacts)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
