"""Resuming an ensemble's training: a member whose adapter was saved is not trained again, here or in another run.

An ensemble trains its ``members`` one after the other (3 x a MAP run: about 33 minutes on a 2-core CPU for the
paper-protocol grid). When the job is killed after some members were saved, the next start trains only the rest.
Each saved member gets ``member.json`` beside its adapter, written last (atomically), holding its training record,
the sha256 of its weight files and a fingerprint of what its training depended on: the config without where the
run is written and how it reports, the member's seed and the base model's digest. A member is resumed only when
that fingerprint and its weight files match; a member without the file (killed mid-training), with another
fingerprint or with weights changed since is trained again. The fingerprint holds the config as written, not the
contents of the files it names (data, ``init_from``): retrain from scratch (delete the output) after changing those.

Every run saves the record, a single adapter's too, and a member is fingerprinted as the method its members train
as (an ensemble's as MAP), so the run of that method with the member's config and seed (an ensemble's first member
is MAP's run of the same seed) fingerprints the same: ``members_from`` names such runs, and a member whose
fingerprint one of them carries is copied from it (:func:`adopt`) instead of trained.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from ibedl.core.artifact import ADAPTER_FILES, HEAD_FILE, atomic_write_text, files_sha256

RECORD = "member.json"
# Config keys that change where a run writes, what it shows, only the float summation order (threads, torch_compile)
# or only what memory holds (gradient_checkpointing), not what it learns from: a member trained under other values is
# the same member.
NOT_TRAINING = ("output", "name", "progress", "track", "track_dir", "threads", "members_from", "torch_compile",
                "gradient_checkpointing")


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


def adopt(donor: Path, member_dir: Path, digest: str, history_path: Path, member: int) -> dict | None:
    """Copy the adapter saved in ``donor`` (a run's directory) into ``member_dir`` as member ``member`` when the
    donor's record carries fingerprint ``digest`` and its weights are unchanged, append the donor's
    ``history.jsonl`` lines to ``history_path`` as that member's, and write the member's record; returns the
    training record, or None (nothing written) when the donor trained otherwise."""
    run = finished(donor, digest)
    if run is None:
        return None
    member_dir.mkdir(parents=True, exist_ok=True)
    (member_dir / RECORD).unlink(missing_ok=True)  # a half-trained member left here is replaced, not resumed
    for name in (*ADAPTER_FILES, HEAD_FILE):  # what makes an adapter directory (calibrate shares the same files)
        shutil.copyfile(donor / name, member_dir / name)
    lines = (donor / "history.jsonl").read_text().splitlines() if (donor / "history.jsonl").is_file() else []
    steps = []
    for line in lines:
        try:
            steps.append(json.dumps({**json.loads(line), "member": member}) + "\n")
        except ValueError:  # a torn line
            continue
    with history_path.open("a") as f:
        f.writelines(steps)
    save(member_dir, digest, run)
    return run


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


__all__ = ["adopt", "fingerprint", "finished", "keep_history", "save", "RECORD"]
