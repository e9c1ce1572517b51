"""The questions an artifact's ``openvino-int8`` trunk is quantised on: NNCF measures its activation ranges on
them, so they decide the int8 arithmetic its calibration holds for. They travel in the artifact as
``quantization_sample.jsonl`` (the JSONL question format of ibedl.training.data.jsonl); the int8 calibration records
the file's sha256 (``calibration.quantization``), so any machine quantises the trunk that calibration was made on,
and a calibration made on a trunk quantised on other questions is refused (ibedl.engine.runtime).

The same trunk does not compute the same numbers on every CPU: int8 matrix products run as exact int32 dot products
where the CPU has VNNI or AMX, but as pairs of u8 x s8 products summed in saturating 16-bit lanes where it has only
AVX2 or AVX512BW, so outputs (and the thresholds calibrated on them) need not carry over. The calibration also
records the int8 instruction set it ran on (``calibration.quantization.isa``, ibedl.core.cpu_isa.int8_isa), and a
calibration made on another one is refused like one made on other questions.
"""

from __future__ import annotations

import json
from pathlib import Path

from ibedl.core.base_model import sha256_file
from ibedl.core.cpu_isa import int8_isa
from ibedl.core.prompt import LETTERS, MCQuestion

FILE = "quantization_sample.jsonl"
QUESTIONS = 300  # training questions the trunk is quantised on (NNCF's default subset size)


def write(directory: str | Path, questions: list[MCQuestion]) -> str:
    """Write ``questions`` (with answers: the JSONL format needs them) as the artifact's quantisation sample;
    returns the file's sha256. ValueError when one has no answer or there are none."""
    if not questions:
        raise ValueError("a quantisation sample needs at least one question")
    lines = []
    for i, q in enumerate(questions):
        if q.answer is None:
            raise ValueError(f"question {i} of the quantisation sample has no answer; the JSONL format needs one")
        record = {"question": q.question, "options": list(q.options), "answer": LETTERS[q.answer]}
        if q.context:
            record["context"] = q.context
        lines.append(json.dumps(record, ensure_ascii=False))
    path = Path(directory) / FILE
    tmp = path.with_name(f".{FILE}.tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(path)
    return sha256_file(path)


def read(directory: str | Path) -> list[MCQuestion] | None:
    """The artifact's quantisation sample (as :func:`write` wrote it), or None when it carries none. ValueError
    naming the line when one is not a question of that format."""
    path = Path(directory) / FILE
    if not path.is_file():
        return None
    questions = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            questions.append(MCQuestion(record["question"], tuple(record["options"]),
                                        answer=LETTERS.index(record["answer"]), context=record.get("context"),
                                        id=f"{path.stem}-{len(questions)}"))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} line {n + 1} is not a question of the quantisation sample: "
                             f"{type(e).__name__}: {e}") from None
    return questions


def sha256(directory: str | Path) -> str | None:
    """sha256 of the artifact's quantisation sample file, or None when it carries none."""
    path = Path(directory) / FILE
    return sha256_file(path) if path.is_file() else None


def mismatch(record: dict, sample_sha256: str | None, isa: str | None = None) -> str | None:
    """Why a calibration (its ``calibration`` record) does not hold for an int8 trunk quantised on the sample whose
    file has ``sample_sha256`` (None: no sample) and run on the int8 instruction set ``isa`` (default: this
    machine's, ibedl.core.cpu_isa.int8_isa), or None when it does."""
    quantization = record.get("quantization") or {}
    recorded = quantization.get("sha256")
    if recorded is None:
        return "the calibration does not record the questions its int8 trunk was quantised on"
    if sample_sha256 is None:
        return f"the artifact carries no {FILE} to quantise on"
    if recorded != sample_sha256:
        return f"the calibration was made on a trunk quantised on other questions than the artifact's {FILE}"
    isa = isa or int8_isa()
    made_on = quantization.get("isa")
    if made_on is None:
        return f"the calibration does not record the int8 instruction set it ran on (this CPU runs {isa})"
    if made_on != isa:
        return (f"the calibration was made on int8 arithmetic of another instruction set ({made_on}; this CPU "
                f"runs {isa})")
    return None


__all__ = ["FILE", "QUESTIONS", "write", "read", "sha256", "mismatch"]
