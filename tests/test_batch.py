"""python -m ibedl.batch survives any single line: deeply nested JSON, a line longer than the limit (never held
whole), bytes that are not UTF-8, integers Python refuses to convert, and an unexpected exception while checking
one line; each becomes an error record at its line number and the lines around it are answered. What would stop a
run is refused before the model is loaded, in one line with exit status 2, and a failed run leaves neither a stray
``.partial`` file nor a changed input or output."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

import ibedl.batch as batch
from ibedl.batch import TooLong, main, read_lines, score
from ibedl.engine.errors import ModelError

GOOD = {"question": "Which is sun?", "options": ["sun", "moon", "tree"]}


class TestReadLines:
    def test_lines_up_to_the_limit_pass_and_longer_ones_are_sized_not_held(self):
        src = io.BytesIO(b"abc\n" + b"abcde\n" + b"abcdef\n" + b"x" * 23 + b"\n" + b"\n" + b"tail!")
        assert list(read_lines(src, limit=5)) == [
            (1, b"abc\n"), (2, b"abcde\n"), (3, TooLong(7)), (4, TooLong(24)), (5, b"\n"), (6, b"tail!")]

    def test_a_last_line_over_the_limit_without_a_newline(self):
        assert list(read_lines(io.BytesIO(b"ok\n" + b"y" * 9), limit=5)) == [(1, b"ok\n"), (2, TooLong(9))]

    def test_reads_are_bounded_by_the_limit(self):
        sizes = []

        class Spy(io.BytesIO):
            def readline(self, size=-1):
                sizes.append(size)
                return super().readline(size)

        list(read_lines(Spy(b"z" * 10_000 + b"\nok\n"), limit=100))
        assert sizes and all(0 < s <= 101 for s in sizes)

    def test_a_limit_below_one_byte_is_refused(self):
        with pytest.raises(ValueError, match="limit must be >= 1 byte, got 0"):
            list(read_lines(io.BytesIO(b"x\n"), limit=0))


def test_no_single_line_stops_the_run(tiny_artifact, tmp_path, capsys):
    lines = [
        json.dumps({**GOOD, "id": "first"}).encode(),
        b"[" * 5000,  # nested past the recursion limit (1000): RecursionError in the JSON decoder
        json.dumps({**GOOD, "question": "x" * 9000}).encode(),  # over --max-line-bytes 8000
        b"\xff\xfe\x00binary\x80\x81",  # not UTF-8
        b'{"question": "q", "options": ["a", "b"], "id": ' + b"1" * 5000 + b"}",  # more digits than int() converts
        json.dumps({"question": "q", "options": ["a", "b"], "colour": [[[[[[["deep"]]]]]]]}).encode(),
        b'{"question": "\\ud800", "options": ["a", "b"], "id": "\\ud800"}',  # a lone surrogate escape
        json.dumps({**GOOD, "id": "last"}).encode(),
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "new" / "out.jsonl"  # its folder is made
    src.write_bytes(b"\n".join(lines) + b"\n")
    assert main(["--artifact", str(tiny_artifact), "--input", str(src), "--output", str(out), "--no-progress",
                 "--max-line-bytes", "8000"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == len(lines)
    first, nested, long, binary, digits, extra, surrogate, last = records
    assert first["id"] == "first" and last["id"] == "last" and "prediction" in first and "prediction" in last
    assert nested == {"line": 2, "error": {"type": "invalid_json", "message": "line 2 is nested too deeply to read",
                                           "field": None}}
    assert long["line"] == 3 and long["error"]["type"] == "too_large"
    assert long["error"]["message"] == f"line 3 is {len(lines[2]) + 1} bytes; the limit is 8000 (--max-line-bytes)"
    assert binary["line"] == 4 and binary["error"]["type"] == "invalid_body"
    assert digits["line"] == 5 and digits["error"]["type"] == "invalid_json"
    assert extra["line"] == 6 and extra["error"]["field"] == "colour"
    assert surrogate["line"] == 7 and surrogate["error"]["field"] == "question"  # not text: refused, not a crash
    assert "refused ->" in capsys.readouterr().err


def test_an_unexpected_exception_on_one_line_is_its_error_record(monkeypatch, caplog):
    def check_line(model, line, text, adapter, limit):
        raise TypeError("a bug")

    monkeypatch.setattr(batch, "check_line", check_line)
    out = io.StringIO()
    assert score(object(), [(1, "{}"), (2, "{}")], out, batch_size=8) == (0, 2)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["line"] for r in records] == [1, 2]
    assert records[0]["error"] == {"type": "internal_error", "field": None,
                                   "message": "line 1 could not be checked (TypeError); it is skipped"}
    assert "checking line 1 failed" in caplog.text and "a bug" in caplog.text  # the traceback is in the log


def test_max_line_bytes_must_be_positive(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("{}\n")
    with pytest.raises(SystemExit) as e:
        main(["--artifact", "x", "--input", str(src), "--output", str(tmp_path / "o"), "--max-line-bytes", "0"])
    assert e.value.code == 2


KEY = "k" * 32  # a receipt key long enough


def exit_status(argv: list[str]) -> int:
    """main's exit status, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def error_line(capsys) -> str:
    """The last line on stderr, after checking that no traceback came before it."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def questions(path: Path, n: int = 3) -> Path:
    path.write_text("".join(json.dumps({**GOOD, "id": str(i)}) + "\n" for i in range(n)))
    return path


@pytest.fixture
def no_loading(monkeypatch):
    """A load that fails the test: what is refused on arrival loads no model."""

    def load(*artifacts, **settings):
        raise AssertionError(f"a model was loaded from {artifacts}")

    monkeypatch.setattr(batch, "load", load)


@pytest.fixture
def feedback_env(tmp_path, monkeypatch):
    monkeypatch.setenv("IBEDL_FEEDBACK_KEY", KEY)
    monkeypatch.setenv("IBEDL_FEEDBACK_DB", str(tmp_path / "feedback.sqlite"))


class TestOutputOntoTheInput:
    @pytest.mark.parametrize("flag", ["--input", "--feedback"])
    @pytest.mark.parametrize("spelling", ["same path", "other spelling", "symlink", "its .partial"])
    def test_is_refused_before_loading_naming_the_path(self, spelling, flag, tmp_path, no_loading, capsys):
        src = questions(tmp_path / "in.jsonl")
        output = src
        if spelling == "other spelling":
            (tmp_path / "sub").mkdir()
            output = tmp_path / "sub" / ".." / "in.jsonl"
        elif spelling == "symlink":
            (tmp_path / "link.jsonl").symlink_to(src)
            src = tmp_path / "link.jsonl"
        elif spelling == "its .partial":  # the .partial is opened for writing before anything is read
            src = src.rename(tmp_path / "out.jsonl.partial")
            output = tmp_path / "out.jsonl"
        before = src.read_bytes()
        assert exit_status(["--artifact", "never-loaded", flag, str(src), "--output", str(output)]) == 2
        assert error_line(capsys).endswith(f"error: --output {output} would overwrite the input {src} (the same "
                                           "file); write to another file")
        assert src.read_bytes() == before


class TestSetupErrorsAreOneLine:
    """A setup error is one line ``error: ...`` naming what is wrong, exit status 2; the input, an existing output
    and the output's directory are as they were."""

    @pytest.fixture
    def files(self, tmp_path):
        src, out = questions(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
        out.write_text("old\n")
        return src, out

    def unchanged(self, files):
        src, out = files
        assert src.read_bytes() == questions(src.with_name("again.jsonl")).read_bytes()
        assert out.read_text() == "old\n"
        assert not list(out.parent.glob("*.partial"))

    @staticmethod
    def broken(tiny_artifact, tmp_path, how: str) -> Path:
        copy = Path(shutil.copytree(tiny_artifact, tmp_path / "broken"))
        if how == "corrupt manifest":
            (copy / "manifest.json").write_text("{")
        elif how == "no head":
            (copy / "head.safetensors").unlink()
        elif how == "changed weights":
            head = bytearray((copy / "head.safetensors").read_bytes())
            head[-1] ^= 0xFF
            (copy / "head.safetensors").write_bytes(bytes(head))
        return copy

    @pytest.mark.parametrize(("mode", "how", "says"), [
        ("--input", "missing", "missing/manifest.json not found"),
        ("--input", "corrupt manifest", "manifest.json: invalid JSON"),
        ("--input", "no head", "head.safetensors not found"),
        ("--input", "changed weights", "weight files ['head.safetensors'] differ from the sha256 the manifest records"),
        ("--feedback", "missing", "missing/manifest.json not found"),  # recording labels reads the manifest only
        ("--feedback", "corrupt manifest", "manifest.json: invalid JSON"),
    ], ids=["missing", "corrupt manifest", "no head", "changed weights", "feedback missing", "feedback corrupt"])
    def test_an_artifact_that_does_not_load(self, mode, how, says, tiny_artifact, files, tmp_path, feedback_env,
                                            capsys):
        artifact = tmp_path / "missing" if how == "missing" else self.broken(tiny_artifact, tmp_path, how)
        src, out = files
        assert exit_status(["--artifact", str(artifact), mode, str(src), "--output", str(out), "--no-progress"]) == 2
        line = error_line(capsys)
        assert line.startswith("error: ") and says in line and str(artifact) in line
        self.unchanged(files)

    def test_two_adapters_of_one_name(self, tiny_artifact, files, tmp_path, capsys):
        src, out = files
        twin = shutil.copytree(tiny_artifact, tmp_path / "twin")
        assert exit_status(["--artifact", str(tiny_artifact), "--artifact", str(twin), "--input", str(src),
                            "--output", str(out), "--no-progress"]) == 2
        assert error_line(capsys) == ("error: two adapters are named 'tiny'; adapters served together need distinct "
                                      "manifest names")
        self.unchanged(files)

    @pytest.mark.parametrize("mode", ["--input", "--feedback"])
    def test_the_same_artifact_twice_names_the_flag_not_a_variable(self, mode, files, tmp_path, no_loading,
                                                                  feedback_env, capsys):
        src, out = files
        assert exit_status(["--artifact", str(tmp_path), "--artifact", f"{tmp_path}/", mode, str(src), "--output",
                            str(out)]) == 2
        line = error_line(capsys)
        assert line.endswith(f"error: --artifact {tmp_path}/ is given twice") and "IBEDL_ARTIFACTS" not in line
        self.unchanged(files)

    @pytest.mark.parametrize(("variable", "value", "says"), [
        ("IBEDL_MAX_TOKENS", "abc", "IBEDL_MAX_TOKENS: Input should be a valid integer, unable to parse string as an "
         "integer (got 'abc')"),
        ("IBEDL_DEVICE", "bogus", "IBEDL_DEVICE: Value error, device 'bogus' is not cpu, cuda or cuda:<index>"),
        ("IBEDL_FEEDBACK_KEY", "short", "IBEDL_FEEDBACK_KEY: Value error, feedback_key must be at least 16 "
         "characters (e.g. openssl rand -hex 32), got 5"),
    ], ids=["max_tokens", "device", "feedback_key"])
    @pytest.mark.parametrize("mode", ["--input", "--feedback"])
    def test_invalid_settings(self, variable, value, says, mode, files, feedback_env, no_loading, monkeypatch,
                              capsys):
        monkeypatch.setenv(variable, value)
        src, out = files
        assert exit_status(["--artifact", "never-loaded", mode, str(src), "--output", str(out)]) == 2
        line = error_line(capsys)
        assert line.startswith("error: invalid settings: ") and says in line
        if variable == "IBEDL_FEEDBACK_KEY":
            assert "(got" not in line  # a secret is never shown
        self.unchanged(files)

    @pytest.mark.parametrize("mode", ["--input", "--feedback"])
    @pytest.mark.parametrize("where", ["under a file", "a directory"])
    def test_an_output_that_cannot_be_written(self, where, mode, files, tmp_path, no_loading, feedback_env, capsys):
        src, _ = files
        if where == "a directory":
            output, says = tmp_path / "results", f"--output {tmp_path / 'results'} is a directory: name a file"
            output.mkdir()
        else:
            output = src / "out.jsonl"
            says = f"--output {output}: {src} is a file, not a directory"
        assert exit_status(["--artifact", "never-loaded", mode, str(src), "--output", str(output)]) == 2
        assert error_line(capsys).endswith(f"error: {says}")
        self.unchanged(files)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["again.jsonl", "in.jsonl", "out.jsonl"] + (
            ["results"] if where == "a directory" else []))

    def test_an_output_directory_that_is_not_writable(self, files, tmp_path, no_loading, capsys, monkeypatch):
        import tempfile

        def refused(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(tempfile, "TemporaryFile", refused)  # how a read-only folder answers, even to root
        src, _ = files
        assert exit_status(["--artifact", "never-loaded", "--input", str(src), "--output",
                            str(tmp_path / "out2.jsonl")]) == 2
        assert error_line(capsys).endswith(f"cannot write in {tmp_path} (Permission denied)")


class TestBatchSize:
    def test_more_than_the_queue_holds_is_refused_naming_both(self, tmp_path, no_loading, capsys):
        src = questions(tmp_path / "in.jsonl", 300)
        assert exit_status(["--artifact", "never-loaded", "--input", str(src), "--output", str(tmp_path / "o"),
                            "--batch-size", "300"]) == 2
        assert error_line(capsys).endswith("error: --batch-size 300 is more than the engine's queue holds "
                                           "(IBEDL_QUEUE_SIZE=256): give at most 256, or raise IBEDL_QUEUE_SIZE")
        assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()

    def test_as_many_as_the_queue_holds_are_scored(self, tiny_artifact, tmp_path, monkeypatch):
        monkeypatch.setenv("IBEDL_QUEUE_SIZE", "4")
        monkeypatch.setenv("IBEDL_MAX_BATCH_SIZE", "2")  # a request of 4 runs in passes of at most 2
        src, out = questions(tmp_path / "in.jsonl", 6), tmp_path / "out.jsonl"
        assert main(["--artifact", str(tiny_artifact), "--input", str(src), "--output", str(out), "--no-progress",
                     "--batch-size", "4"]) == 0
        assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["0", "1", "2", "3", "4", "5"]


class TestAFailedRun:
    def test_leaves_no_partial_file_and_the_old_output(self, tiny_artifact, tmp_path, monkeypatch):
        def score(model, lines, out, *args):
            out.write("half\n")
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(batch, "score", score)
        src, out = questions(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
        out.write_text("old\n")
        with pytest.raises(OSError, match="No space left"):  # not a setup error: it is raised as it is
            main(["--artifact", str(tiny_artifact), "--input", str(src), "--output", str(out), "--no-progress"])
        assert out.read_text() == "old\n" and not (tmp_path / "out.jsonl.partial").exists()

    def test_recording_labels_leaves_no_partial_file(self, tiny_artifact, tmp_path, feedback_env, monkeypatch):
        def record_lines(feedback, served, lines, out, limit):
            out.write("half\n")
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(batch, "record_lines", record_lines)
        labels, out = tmp_path / "labels.jsonl", tmp_path / "out.jsonl"
        labels.write_text("{}\n")
        with pytest.raises(OSError, match="No space left"):
            main(["--artifact", str(tiny_artifact), "--feedback", str(labels), "--output", str(out)])
        assert not out.exists() and not (tmp_path / "out.jsonl.partial").exists()

    def test_a_broken_model_keeps_what_was_scored_and_says_where(self, tiny_artifact, tmp_path, monkeypatch, capsys):
        def score(model, lines, out, *args):
            out.write("scored\n")
            raise ModelError("non-finite outputs")

        monkeypatch.setattr(batch, "score", score)
        src, out = questions(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
        assert main(["--artifact", str(tiny_artifact), "--input", str(src), "--output", str(out),
                     "--no-progress"]) == 1
        partial = tmp_path / "out.jsonl.partial"
        assert error_line(capsys) == f"error: non-finite outputs; what was scored is in {partial}"
        assert partial.read_text() == "scored\n" and not out.exists()
