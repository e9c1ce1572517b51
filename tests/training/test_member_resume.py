"""member_resume: the fingerprint, the member record written and read back, the history kept for resumed members."""

import json

from ibedl.core.artifact import WEIGHT_FILES
from ibedl.training import member_resume

CONFIG = {"method": "ensemble", "seed": 0, "optim": {"lr": 1e-4}, "output": "runs/a", "threads": 1, "progress": True}


def test_fingerprint_follows_what_training_depends_on_only():
    base = member_resume.fingerprint(CONFIG, 0, "abc")
    assert member_resume.fingerprint(dict(CONFIG), 0, "abc") == base
    # where the run is written and how it reports do not change what a member learns
    reporting = {"output": "elsewhere", "threads": 2, "progress": False}
    assert member_resume.fingerprint({**CONFIG, **reporting}, 0, "abc") == base
    # the config, the member's seed and the base model do
    assert member_resume.fingerprint({**CONFIG, "optim": {"lr": 1e-3}}, 0, "abc") != base
    assert member_resume.fingerprint(CONFIG, 1000, "abc") != base
    assert member_resume.fingerprint(CONFIG, 0, "abd") != base


def weights(member_dir, content=b"w"):
    for name in WEIGHT_FILES:
        (member_dir / name).write_bytes(content + name.encode())


def test_a_saved_record_is_read_back_under_its_fingerprint_and_weights_only(tmp_path):
    run = {"seconds": 12.5, "ids": [1, 2, 3], "head": {"kind": "softmax"}, "resolved": object(), "seed": 1000}
    weights(tmp_path)
    member_resume.save(tmp_path, "f1", run)
    assert member_resume.finished(tmp_path, "f1") == {"seconds": 12.5, "ids": [1, 2, 3], "head": {"kind": "softmax"},
                                                      "seed": 1000}
    assert member_resume.finished(tmp_path, "f2") is None  # trained under another config
    assert member_resume.finished(tmp_path / "absent", "f1") is None  # never saved
    weights(tmp_path, b"changed")  # weights rewritten after the record: not the member it describes
    assert member_resume.finished(tmp_path, "f1") is None
    weights(tmp_path)
    assert member_resume.finished(tmp_path, "f1") is not None
    (tmp_path / WEIGHT_FILES[0]).unlink()
    assert member_resume.finished(tmp_path, "f1") is None
    (tmp_path / member_resume.RECORD).write_text('{"fingerprint": "f1", "run": {"sec')  # torn
    assert member_resume.finished(tmp_path, "f1") is None
    (tmp_path / member_resume.RECORD).write_text('["f1"]')
    assert member_resume.finished(tmp_path, "f1") is None


def test_keep_history_keeps_the_resumed_members_lines(tmp_path):
    path = tmp_path / "history.jsonl"
    lines = [{"member": m, "step": s} for m in (0, 1, 2) for s in (1, 2)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"member": 2, "st')  # a torn last line
    member_resume.keep_history(path, {0, 2})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"member": 0, "step": 1}, {"member": 0, "step": 2}, {"member": 2, "step": 1}, {"member": 2, "step": 2}]
    member_resume.keep_history(path, set())
    assert path.read_text() == ""
    member_resume.keep_history(tmp_path / "new.jsonl", set())  # a first start: an empty history
    assert (tmp_path / "new.jsonl").read_text() == ""


def test_adopt_copies_a_donor_that_trained_the_member_and_nothing_else(tmp_path):
    donor, member_dir, history = tmp_path / "map-s0", tmp_path / "ens" / "members" / "1", tmp_path / "history.jsonl"
    donor.mkdir()
    weights(donor)
    (donor / "adapter_config.json").write_text('{"r": 8}')
    (donor / "history.jsonl").write_text('{"member": 0, "step": 1}\n{"member": 0, "step": 2}\n{"member": 0, "st')
    (donor / "manifest.json").write_text("{}")  # the donor's own run: not part of a member
    member_resume.save(donor, "f1", {"seconds": 3.0, "seed": 0})
    history.write_text('{"member": 0, "step": 1}\n')
    assert member_resume.adopt(donor, member_dir, "f2", history, 1) is None  # another training: nothing written
    assert not member_dir.exists() and history.read_text() == '{"member": 0, "step": 1}\n'
    assert member_resume.adopt(donor, member_dir, "f1", history, 1) == {"seconds": 3.0, "seed": 0}
    assert sorted(p.name for p in member_dir.iterdir()) == sorted([*WEIGHT_FILES, "adapter_config.json", "member.json"])
    for name in (*WEIGHT_FILES, "adapter_config.json"):
        assert (member_dir / name).read_bytes() == (donor / name).read_bytes()
    assert member_resume.finished(member_dir, "f1") == {"seconds": 3.0, "seed": 0}  # a record of its own, read back
    # the donor's steps, as this member's, after the lines already there (its torn last line left out)
    assert [json.loads(line) for line in history.read_text().splitlines()] == [
        {"member": 0, "step": 1}, {"member": 1, "step": 1}, {"member": 1, "step": 2}]
    weights(donor, b"changed")  # weights rewritten after the donor's record: not copied
    assert member_resume.adopt(donor, tmp_path / "other", "f1", history, 2) is None
