"""Score a JSONL file of questions into a JSONL file of predictions, without the HTTP server:

    python -m ibedl.batch --artifact artifacts/default --input questions.jsonl --output predictions.jsonl

Each input line is a ``POST /predict`` body; each output line is, in the same order, its answer (the service's
record; ``id`` defaults to the line number) or ``{"line": N, "error": {"type", "message", "field"}}`` for a
line the service would refuse (bad JSON, nested too deeply, not UTF-8, longer than ``--max-line-bytes``, invalid
body, over a limit): one bad line never stops the run, whatever it holds. A line over the limit is read past in
chunks, never held in memory whole. Blank lines are skipped. The output is written to ``OUTPUT.partial`` and
flushed after every batch, then renamed to OUTPUT when every line is scored: an interrupted run leaves what it
scored in the ``.partial`` file and never a truncated OUTPUT. With ``IBEDL_FEEDBACK_KEY`` set, each answer carries its
signed receipt, as the service's do.

Everything that could stop a run is checked before the model is loaded (an output that would overwrite the input or
cannot be written, an artifact given twice, invalid ``IBEDL_*`` settings, a ``--batch-size`` the engine's queue cannot
hold); a refusal, or an artifact that does not load, is one line ``error: ...`` and exit status 2. A run that fails
removes its ``.partial`` file, except when it was interrupted or the model's outputs were not finite (the message
says where what was scored is).

Labels collected later are recorded with the same command, without loading the model:

    python -m ibedl.batch --artifact artifacts/default --feedback labels.jsonl --output recorded.jsonl

Each line of ``labels.jsonl`` is a ``POST /v1/feedback`` body (``{"receipt": ..., "label": "B"}``); each output line
is its result (``status`` recorded or duplicate) or its error record. The labels go to the feedback store
``IBEDL_FEEDBACK_DB`` (the service's, when they share it), checked with ``IBEDL_FEEDBACK_KEY``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from ibedl.api import Checked, Model, load
from ibedl.core.artifact import read_manifest
from ibedl.core.paths import check_writable
from ibedl.engine.errors import EngineError, StoreUnavailable, error_body
from ibedl.engine.feedback import Feedback
from ibedl.engine.feedback_kinds import STORE_SETTINGS, persistent
from ibedl.engine.schemas import FeedbackRequest
from ibedl.engine.settings import EngineSettings, settings_errors

MAX_LINE_BYTES = 1_000_000  # as the service's default limit on a body (IBEDL_MAX_BODY_BYTES)
log = logging.getLogger("ibedl.batch")


@dataclass(frozen=True)
class TooLong:
    """A line longer than the limit, read past without being held: its size in bytes (newline included)."""

    size: int


def error_record(line: int, type_: str, message: str, field: str | None = None) -> dict:
    return {"line": line, **error_body(type_, message, field)}


def read_lines(src, limit: int = MAX_LINE_BYTES):
    """(line number, bytes) of each line of the binary file ``src``; a line of more than ``limit`` bytes (its
    newline aside) gives a TooLong, and is read past in chunks of at most ``limit`` bytes."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1 byte, got {limit}")
    number = 0
    while raw := src.readline(limit + 1):
        number += 1
        if raw.endswith(b"\n") or len(raw) <= limit:
            yield number, raw
            continue
        size = len(raw)
        while chunk := src.readline(limit):
            size += len(chunk)
            if chunk.endswith(b"\n"):
                break
        yield number, TooLong(size)


def decoded(numbered):
    """(line number, text) of each (line number, bytes) pair; a line that is not UTF-8 gives its UnicodeDecodeError
    instead of stopping the run (a byte-order mark before line 1 is dropped); a TooLong passes through."""
    for number, raw in numbered:
        if isinstance(raw, TooLong):
            yield number, raw
            continue
        try:
            yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as e:
            yield number, e


def unreadable(line: int, text, limit: int) -> dict | None:
    """The error record of a line that could not be read as text (too long, not UTF-8); None for a text."""
    if isinstance(text, TooLong):
        return error_record(line, "too_large", f"line {line} is {text.size} bytes; the limit is {limit} "
                            "(--max-line-bytes)")
    if isinstance(text, UnicodeDecodeError):
        return error_record(line, "invalid_body", f"line {line} is not UTF-8: {text.reason} at byte {text.start}")
    return None


def check_line(model: Model, line: int, text: str | UnicodeDecodeError | TooLong, adapter: str | None,
               limit: int = MAX_LINE_BYTES) -> Checked | dict:
    """The checked question of one input line, or its error record."""
    if (unread := unreadable(line, text, limit)) is not None:
        return unread
    try:
        body = json.loads(text)
    except RecursionError:
        return error_record(line, "invalid_json", f"line {line} is nested too deeply to read")
    except ValueError as e:  # JSONDecodeError, and an integer of more digits than Python converts
        return error_record(line, "invalid_json", f"line {line} is not JSON: {e}")
    try:
        return model.check(body, adapter=adapter)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())) or None
        return error_record(line, "invalid_request", f"line {line}: {first['msg']}", field)
    except EngineError as e:
        return error_record(line, e.type, f"line {line}: {e.message}", e.field)
    except RecursionError:
        return error_record(line, "invalid_request", f"line {line} is nested too deeply to check")


def checked_line(model: Model, line: int, text, adapter: str | None, limit: int = MAX_LINE_BYTES) -> Checked | dict:
    """:func:`check_line`, and an error record for whatever else one line could raise: a line never stops a run
    (the traceback goes to the log: it is a bug to fix)."""
    try:
        return check_line(model, line, text, adapter, limit)
    except Exception as e:
        log.exception("checking line %d failed", line)
        return error_record(line, "internal_error", f"line {line} could not be checked ({type(e).__name__}); it is "
                            "skipped")


def score(model: Model, lines, out, batch_size: int, adapter: str | None = None, progress=None,
          limit: int = MAX_LINE_BYTES) -> tuple[int, int]:
    """Score numbered input ``lines`` ((number, text) pairs) into the open file ``out``, ``batch_size`` at a time
    (``limit``: the line length behind a TooLong, for its message). Returns (answered, refused)."""
    answered = refused = 0
    pending: list[tuple[int, Checked | dict]] = []

    def flush() -> None:
        nonlocal answered, refused
        good = [(n, c) for n, c in pending if isinstance(c, Checked)]
        answers = iter(model.answer([c for _, c in good], batch_size, [str(n) for n, _ in good]) if good else [])
        for _n, c in pending:
            record = next(answers).model_dump() if isinstance(c, Checked) else c
            out.write(json.dumps(record) + "\n")
        out.flush()
        answered += len(good)
        refused += len(pending) - len(good)
        if progress is not None:
            progress.update(len(pending))
        pending.clear()

    for number, text in lines:
        if isinstance(text, str) and not text.strip():
            continue
        pending.append((number, checked_line(model, number, text, adapter, limit)))
        if len(pending) >= batch_size:
            flush()
    flush()
    return answered, refused


def record_lines(feedback: Feedback, served: dict[str, str], lines, out,
                 limit: int = MAX_LINE_BYTES) -> tuple[int, int, int]:
    """Record the label of each numbered input line ((number, text) pairs; each its own all-or-none request) and
    write its result or error record to the open file ``out``. Returns (recorded, duplicates, refused)."""
    recorded = duplicates = refused = 0
    for number, text in lines:
        if isinstance(text, str) and not text.strip():
            continue
        record = _record_line(feedback, served, number, text, limit)
        status = record.get("status")
        recorded += status == "recorded"
        duplicates += status == "duplicate"
        refused += status is None
        out.write(json.dumps(record) + "\n")
    out.flush()
    return recorded, duplicates, refused


def _record_line(feedback: Feedback, served: dict[str, str], line: int, text, limit: int) -> dict:
    """The result or error record of one label line (its own all-or-none request)."""
    if (unread := unreadable(line, text, limit)) is not None:
        return unread
    try:
        item = FeedbackRequest.model_validate(json.loads(text))
        (result,) = feedback.record(served, [(item.receipt, item.label)])
    except RecursionError:
        return error_record(line, "invalid_json", f"line {line} is nested too deeply to read")
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())) or None
        return error_record(line, "invalid_request", f"line {line}: {first['msg']}", field)
    except ValueError as e:  # JSONDecodeError, and an integer of more digits than Python converts
        return error_record(line, "invalid_json", f"line {line} is not JSON: {e}")
    except EngineError as e:
        return error_record(line, e.type, f"line {line}: {e.message}", e.field)
    except Exception as e:  # a line never stops a run; the traceback goes to the log: it is a bug to fix
        log.exception("recording line %d failed", line)
        return error_record(line, "internal_error", f"line {line} could not be recorded ({type(e).__name__}); it "
                            "is skipped")
    return {"line": line, **result}


def partial_path(output: Path) -> Path:
    """Where the output is written until every line is done (then renamed to ``output``)."""
    return output.with_name(output.name + ".partial")


def output_problem(output: Path, source: Path) -> str | None:
    """Why the results of reading ``source`` cannot be written to ``output`` (through its ``.partial`` file), or None:
    checked before a model is loaded, not found when the results are ready."""
    try:
        check_writable(output, "--output")  # a folder it lacks is made when it is written
    except ValueError as e:
        return str(e)
    for target in (output, partial_path(output)):  # the .partial is written first: it must not be the input either
        if target.exists() and os.path.samefile(target, source):  # any spelling of the path, a link
            return f"--output {output} would overwrite the input {source} (the same file); write to another file"
    return None


@contextmanager
def replacing(output: Path, keep: tuple[type[Exception], ...] = ()):
    """The open ``OUTPUT.partial`` (text), renamed to ``output`` once the block ends and the file is on disk. If the
    block raises, the ``.partial`` file is removed, unless the exception is one of ``keep`` or an interruption
    (Ctrl-C): then what was written stays there. An ``output`` that existed is untouched either way."""
    partial = partial_path(output)
    partial.parent.mkdir(parents=True, exist_ok=True)
    try:
        with partial.open("w", encoding="utf-8") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, output)
    except keep:
        raise
    except Exception:
        partial.unlink(missing_ok=True)
        raise


def feedback_main(settings: EngineSettings, labels: Path, output: Path, limit: int = MAX_LINE_BYTES) -> int:
    """``--feedback``: record labels into the feedback store (IBEDL_FEEDBACK_DB or IBEDL_FEEDBACK_DSN) for the adapter
    versions of ``settings.artifacts``."""
    if settings.feedback_key is None or not persistent(settings):  # labels kept in memory would be lost at exit
        print("error: recording labels needs IBEDL_FEEDBACK_KEY (the key that signed the receipts) and "
              f"{STORE_SETTINGS} (the feedback store to record into)", file=sys.stderr)
        return 2
    served = {}
    try:
        for a in settings.artifacts:
            manifest = read_manifest(a)
            served[manifest.name] = str(manifest.version)
    except (ValueError, OSError) as e:  # ArtifactError: not an adapter directory, a manifest that does not read
        print(f"error: {e}", file=sys.stderr)
        return 2
    feedback = Feedback(settings)
    try:
        feedback.bind({})  # opens the store; no model is loaded, so no adaptive thresholds are needed
    except (ValueError, OSError, StoreUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with labels.open("rb") as src, replacing(output) as out:
        recorded, duplicates, refused = record_lines(feedback, served, decoded(read_lines(src, limit)), out, limit)
    print(f"{recorded} recorded, {duplicates} duplicates, {refused} refused -> {output}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ibedl.batch", description="Score a JSONL file of POST /predict bodies into a JSONL file of "
        "the service's answers (bad lines become error records with their line number).",
        epilog="Engine settings (IBEDL_MAX_TOKENS, IBEDL_DEVICE, IBEDL_THREADS, ...) apply as in the service: see "
        "python -m ibedl.serve --help.")
    parser.add_argument("--artifact", action="append", required=True,
                        help="adapter directory; repeat for several adapters on one base model (the first is the "
                        "default; a line picks another with its 'adapter' field)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", type=Path, help="JSONL file, one request body per line")
    source.add_argument("--feedback", type=Path, help="JSONL file of labels, one POST /v1/feedback body per line: "
                        "record them (IBEDL_FEEDBACK_KEY, IBEDL_FEEDBACK_DB) instead of scoring questions")
    parser.add_argument("--output", required=True, type=Path, help="JSONL file of answers (or of the labels' "
                        "results), one per input line")
    parser.add_argument("--batch-size", type=int, default=16, help="questions per request to the engine (default 16; "
                        "at most IBEDL_QUEUE_SIZE); its forward passes take at most IBEDL_MAX_BATCH_SIZE of them")
    parser.add_argument("--adapter", help="adapter of the lines that name none (default the first --artifact)")
    parser.add_argument("--max-line-bytes", type=int, default=MAX_LINE_BYTES,
                        help=f"longest line read, in bytes (default {MAX_LINE_BYTES}, as the service's body limit); "
                        "a longer one becomes a too_large error record")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_line_bytes < 1:
        parser.error(f"--max-line-bytes must be >= 1, got {args.max_line_bytes}")
    source, flag = (args.feedback, "--feedback") if args.feedback is not None else (args.input, "--input")
    if not source.is_file():
        parser.error(f"{flag} {source} is not a file")
    if (problem := output_problem(args.output, source)) is not None:
        parser.error(problem)
    seen = set()
    for a in args.artifact:
        if (resolved := Path(a).resolve()) in seen:
            parser.error(f"--artifact {a} is given twice")
        seen.add(resolved)
    try:
        settings = EngineSettings(artifacts=[Path(a) for a in args.artifact])
    except ValidationError as e:
        print(f"error: invalid settings: {settings_errors(e)}", file=sys.stderr)
        return 2
    if args.feedback is not None:
        return feedback_main(settings, args.feedback, args.output, args.max_line_bytes)
    if args.batch_size > settings.queue_size:  # one request must fit in the engine's queue, or it is refused whole
        parser.error(f"--batch-size {args.batch_size} is more than the engine's queue holds (IBEDL_QUEUE_SIZE="
                     f"{settings.queue_size}): give at most {settings.queue_size}, or raise IBEDL_QUEUE_SIZE")
    from tqdm import tqdm

    try:
        model = load(*args.artifact)
    except (ValueError, OSError) as e:  # ArtifactError (missing, corrupt or changed files), two adapters of one name
        print(f"error: {e}", file=sys.stderr)
        return 2
    with model:
        if args.adapter is not None and args.adapter not in model.adapters:
            parser.error(f"--adapter {args.adapter!r} is not loaded; choose one of {model.adapters}")
        with args.input.open("rb") as src:
            total = sum(1 for _, raw in read_lines(src, args.max_line_bytes)
                        if isinstance(raw, TooLong) or raw.strip())
        try:
            with args.input.open("rb") as src, replacing(args.output, keep=(EngineError,)) as out, \
                    tqdm(total=total, unit="q", disable=args.no_progress, file=sys.stderr) as bar:
                answered, refused = score(model, decoded(read_lines(src, args.max_line_bytes)), out,
                                          args.batch_size, args.adapter, bar, args.max_line_bytes)
        except EngineError as e:  # non-finite model outputs: the model is broken, not the line
            print(f"error: {e.message}; what was scored is in {partial_path(args.output)}", file=sys.stderr)
            return 1
    print(f"{answered} answered, {refused} refused -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
