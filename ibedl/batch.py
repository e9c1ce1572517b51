"""Score a JSONL file of questions into a JSONL file of predictions, without the HTTP server:

    python -m ibedl.batch --artifact artifacts/default --input questions.jsonl --output predictions.jsonl

Each input line is a ``POST /predict`` body; each output line is, in the same order, its answer (the service's
record; ``id`` defaults to the line number) or ``{"line": N, "error": {"type", "message", "field"}}`` for a
line the service would refuse (bad JSON, invalid body, over a limit): one bad line never stops the run. Blank
lines are skipped. The output is written to ``OUTPUT.partial`` and flushed after every batch, then renamed to
OUTPUT when every line is scored: an interrupted run leaves what it scored in the ``.partial`` file and never a
truncated OUTPUT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from ibedl.api import Checked, Model, load
from ibedl.engine.errors import EngineError, error_body


def error_record(line: int, type_: str, message: str, field: str | None = None) -> dict:
    return {"line": line, **error_body(type_, message, field)}


def decoded(raw_lines):
    """(line number, text) of each line of a file opened in binary; a line that is not UTF-8 gives its
    UnicodeDecodeError instead of stopping the run (a byte-order mark before line 1 is dropped)."""
    for number, raw in enumerate(raw_lines, start=1):
        try:
            yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as e:
            yield number, e


def check_line(model: Model, line: int, text: str | UnicodeDecodeError, adapter: str | None) -> Checked | dict:
    """The checked question of one input line, or its error record."""
    if isinstance(text, UnicodeDecodeError):
        return error_record(line, "invalid_body", f"line {line} is not UTF-8: {text.reason} at byte {text.start}")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        return error_record(line, "invalid_json", f"line {line} is not JSON: {e}")
    try:
        return model.check(body, adapter=adapter)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())) or None
        return error_record(line, "invalid_request", f"line {line}: {first['msg']}", field)
    except EngineError as e:
        return error_record(line, e.type, f"line {line}: {e.message}", e.field)


def score(model: Model, lines, out, batch_size: int, adapter: str | None = None, progress=None) -> tuple[int, int]:
    """Score numbered input ``lines`` ((number, text) pairs) into the open file ``out``, ``batch_size`` at a time.
    Returns (answered, refused)."""
    answered = refused = 0
    pending: list[tuple[int, Checked | dict]] = []

    def flush() -> None:
        nonlocal answered, refused
        good = [(n, c) for n, c in pending if isinstance(c, Checked)]
        answers = iter(model.answer([c for _, c in good], batch_size, [str(n) for n, _ in good]) if good else [])
        for n, c in pending:
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
        pending.append((number, check_line(model, number, text, adapter)))
        if len(pending) >= batch_size:
            flush()
    flush()
    return answered, refused


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ibedl.batch", description="Score a JSONL file of POST /predict bodies into a JSONL file of "
        "the service's answers (bad lines become error records with their line number).",
        epilog="Engine settings (IBEDL_MAX_TOKENS, IBEDL_DEVICE, IBEDL_THREADS, ...) apply as in the service: see "
        "python -m ibedl.serve --help.")
    parser.add_argument("--artifact", action="append", required=True,
                        help="adapter directory; repeat for several adapters on one base model (the first is the "
                        "default; a line picks another with its 'adapter' field)")
    parser.add_argument("--input", required=True, type=Path, help="JSONL file, one request body per line")
    parser.add_argument("--output", required=True, type=Path, help="JSONL file of answers, one per input line")
    parser.add_argument("--batch-size", type=int, default=16, help="questions per forward pass (default 16)")
    parser.add_argument("--adapter", help="adapter of the lines that name none (default the first --artifact)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if not args.input.is_file():
        parser.error(f"--input {args.input} is not a file")
    from tqdm import tqdm

    model = load(*args.artifact)
    if args.adapter is not None and args.adapter not in model.adapters:
        parser.error(f"--adapter {args.adapter!r} is not loaded; choose one of {model.adapters}")
    with args.input.open("rb") as src:
        total = sum(1 for raw in src if raw.strip())
    partial = args.output.with_name(args.output.name + ".partial")
    with args.input.open("rb") as src, partial.open("w", encoding="utf-8") as out, \
            tqdm(total=total, unit="q", disable=args.no_progress, file=sys.stderr) as bar:
        try:
            answered, refused = score(model, decoded(src), out, args.batch_size, args.adapter, bar)
        except EngineError as e:  # non-finite model outputs: the model is broken, not the line
            print(f"error: {e.message}; what was scored is in {partial}", file=sys.stderr)
            return 1
        os.fsync(out.fileno())
    os.replace(partial, args.output)
    print(f"{answered} answered, {refused} refused -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
