"""python -m ibedl.training.evaluate (ibedl-evaluate): arguments that cannot work are refused with one line naming
them, exit 2, before the model loads; what it writes is what it says it wrote."""

from __future__ import annotations

import json

import pytest

from ibedl.training.evaluate import main


@pytest.fixture
def model_never_loads(monkeypatch):
    """Loading the model fails the test: a refusal must come before it (and before minutes of work)."""
    from ibedl.core.predictor import Predictor

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were refused")

    monkeypatch.setattr(Predictor, "from_artifact", loaded)


@pytest.fixture
def common(tiny_artifact, tiny_jsonl):
    return ["--artifact", str(tiny_artifact), "--dataset", "jsonl", "--path", str(tiny_jsonl), "--backend", "torch",
            "--limit", "4", "--no-progress"]


class TestRefusedOnArrival:
    @pytest.mark.parametrize("flag, value", [("--batch-size", "0"), ("--batch-size", "-3"), ("--limit", "0")])
    def test_a_count_below_one(self, common, capsys, flag, value, model_never_loads):
        assert main([*common, flag, value]) == 2
        assert capsys.readouterr().err == f"error: {flag} must be >= 1, got {value}\n"

    def test_an_empty_file_of_questions(self, tiny_artifact, tmp_path, capsys, model_never_loads):
        empty = tmp_path / "empty.jsonl"
        empty.write_text("\n")
        assert main(["--artifact", str(tiny_artifact), "--dataset", "jsonl", "--path", str(empty),
                     "--backend", "torch"]) == 2
        assert capsys.readouterr().err == f"error: {empty} holds no questions\n"

    def test_an_output_that_is_a_directory(self, common, tmp_path, capsys, model_never_loads):
        assert main([*common, "--output", str(tmp_path)]) == 2
        assert capsys.readouterr().err == f"error: --output {tmp_path} is a directory: name a file\n"

    def test_an_output_under_a_file(self, common, tmp_path, capsys, model_never_loads):
        (tmp_path / "file").write_text("")
        out = tmp_path / "file" / "m.json"
        assert main([*common, "--output", str(out)]) == 2
        assert capsys.readouterr().err == f"error: --output {out}: {tmp_path / 'file'} is a file, not a directory\n"

    def test_an_output_whose_diagram_would_be_a_directory(self, common, tmp_path, capsys, model_never_loads):
        (tmp_path / "m.png").mkdir()
        assert main([*common, "--output", str(tmp_path / "m.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --output {tmp_path / 'm.json'}: its reliability diagram {tmp_path / 'm.png'} "
                              "is a directory") and err.count("\n") == 1

    @pytest.mark.parametrize("name", ["m.png", "m.PNG"])
    def test_an_output_named_as_the_diagram_would_be_overwritten_by_it(self, common, tmp_path, capsys, name,
                                                                      model_never_loads):
        assert main([*common, "--output", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --output {tmp_path / name} is where the reliability diagram goes")
        assert err.count("\n") == 1 and list(tmp_path.iterdir()) == []


def test_writes_the_metrics_and_the_diagram_beside_them(common, tmp_path, capsys):
    out = tmp_path / "new" / "m.json"  # missing folders are made
    assert main([*common, "--output", str(out)]) == 0
    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["n"] == 4 and report == json.loads(captured.out)
    assert (tmp_path / "new" / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out} and {tmp_path / 'new' / 'm.png'}\n" in captured.err
