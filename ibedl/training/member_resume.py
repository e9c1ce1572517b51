"""Resuming an ensemble's training: a member whose adapter was saved is not trained again.

An ensemble trains its ``members`` one after the other (3 x a MAP run: about 33 minutes on a 2-core CPU for the
paper-protocol grid). When the job is killed after some members were saved, the next start trains only the rest.
Each saved member gets ``member.json`` beside its adapter, written last (atomically), holding its training record,
the sha256 of its weight files and a fingerprint of what its training depended on: the config without where the
run is written and how it reports, the member's seed and the base model's digest. A member is resumed only when
that fingerprint and its weight files match; a member without the file (killed mid-training), with another
fingerprint or with weights changed since is trained again. The fingerprint holds the config as written, not the
contents of the files it names (data, ``init_from``): retrain from scratch (delete the output) after changing those.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ibedl.core.artifact import atomic_write_text, files_sha256

RECORD = "member.json"
# config keys that do not change what a member learns
NOT_TRAINING = ("output", "name", "progress", "track", "track_dir", "threads")


def fingerprint(config: dict, seed: int, base_sha256: str) -> str:
    """sha256 of what a member's training depends on: ``config`` (TrainConfig.to_dict) less NOT_TRAINING, its
    ``seed`` and the base model's digest."""
    kept = {k: v for k, v in config.items() if k not in NOT_TRAINING}
    text = json.dumps({"config": kept, "seed": seed, "base_sha256": base_sha256}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def save(member_dir: Path, digest: str, run: dict) -> None:
    """Write ``member_dir/member.json``: the member's training record ``run`` (without the resolved base model, a
    live object) and the sha256 of its weight files under the fingerprint ``digest``. Call it after the member's
    adapter and head are saved."""
    record = {"fingerprint": digest, "files": files_sha256(member_dir, ["."]),
              "run": {k: v for k, v in run.items() if k != "resolved"}}
    atomic_write_text(member_dir / RECORD, json.dumps(record, indent=1) + "\n")


def finished(member_dir: Path, digest: str) -> dict | None:
    """The training record of a member saved under fingerprint ``digest``, or None: no record (never saved, or
    killed before it was), an unreadable one, one trained under another fingerprint, or weight files missing or
    changed since."""
    try:
        found = json.loads((member_dir / RECORD).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict) or found.get("fingerprint") != digest or not isinstance(found.get("run"), dict):
        return None
    try:
        same = files_sha256(member_dir, ["."]) == found.get("files")
    except OSError:
        return None
    return found["run"] if same else None


def keep_history(history_path: Path, members: set[int]) -> None:
    """Truncate ``history.jsonl`` to the lines of the resumed ``members`` (one line per step and member): the
    members trained again append theirs."""
    lines = history_path.read_text().splitlines() if history_path.is_file() else []
    kept = []
    for line in lines:
        try:
            if json.loads(line).get("member") in members:
                kept.append(line + "\n")
        except ValueError:  # a torn last line of a killed writer
            continue
    atomic_write_text(history_path, "".join(kept))


__all__ = ["fingerprint", "finished", "keep_history", "save", "RECORD"]
