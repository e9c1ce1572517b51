"""python -m ibedl.batch survives any single line: deeply nested JSON, a line longer than the limit (never held
whole), bytes that are not UTF-8, integers Python refuses to convert, and an unexpected exception while checking
one line; each becomes an error record at its line number and the lines around it are answered."""

from __future__ import annotations

import io
import json

import pytest

import ibedl.batch as batch
from ibedl.batch import TooLong, main, read_lines, score

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
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
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
