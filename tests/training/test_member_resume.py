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
