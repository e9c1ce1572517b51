"""The artifact's quantisation sample: written and read back as the same questions (so the same prompts quantise
the same trunk anywhere), its sha256 changes with its content, and a calibration is matched against it."""

import pytest

from ibedl.core import cpu_isa, quantization_sample
from ibedl.core.prompt import MCQuestion, format_prompt

QUESTIONS = [
    MCQuestion("Which gas do plants absorb?", ("Oxygen", "Carbon dioxide", "Helium", "Neon"), answer=1,
               context="Plants take in carbon dioxide — and water — to make sugar.\nLight drives it."),
    MCQuestion("2 + 2 = ?", ("3", "4"), answer=1),
]


def test_written_questions_read_back_as_the_same_prompts(tmp_path):
    sha = quantization_sample.write(tmp_path, QUESTIONS)
    assert sha == quantization_sample.sha256(tmp_path) and len(sha) == 64
    back = quantization_sample.read(tmp_path)
    assert [(q.question, q.options, q.context, q.answer) for q in back] == \
        [(q.question, q.options, q.context, q.answer) for q in QUESTIONS]
    assert [format_prompt(q, "plain-v1") for q in back] == [format_prompt(q, "plain-v1") for q in QUESTIONS]
    assert quantization_sample.write(tmp_path, QUESTIONS[:1]) != sha  # other questions, other sha256


def test_an_artifact_without_a_sample_has_none(tmp_path):
    assert quantization_sample.read(tmp_path) is None and quantization_sample.sha256(tmp_path) is None


def test_questions_without_an_answer_or_none_at_all_are_refused(tmp_path):
    with pytest.raises(ValueError, match="question 0 of the quantisation sample has no answer"):
        quantization_sample.write(tmp_path, [MCQuestion("q?", ("a", "b"))])
    with pytest.raises(ValueError, match="at least one question"):
        quantization_sample.write(tmp_path, [])
    assert not (tmp_path / quantization_sample.FILE).exists()


def test_a_calibration_holds_only_for_the_sample_it_records():
    record = {"quantization": {"file": quantization_sample.FILE, "sha256": "a" * 64, "isa": "avx512-vnni"}}
    assert quantization_sample.mismatch(record, "a" * 64, "avx512-vnni") is None
    assert "quantised on other questions" in quantization_sample.mismatch(record, "b" * 64, "avx512-vnni")
    assert "carries no quantization_sample.jsonl" in quantization_sample.mismatch(record, None, "avx512-vnni")
    assert "does not record the questions" in quantization_sample.mismatch({}, "a" * 64, "avx512-vnni")


def test_a_calibration_holds_only_for_the_int8_instruction_set_it_ran_on():
    record = {"quantization": {"file": quantization_sample.FILE, "sha256": "a" * 64, "isa": "avx512-vnni"}}
    assert quantization_sample.mismatch(record, "a" * 64, "avx2") == (
        "the calibration was made on int8 arithmetic of another instruction set (avx512-vnni; this CPU runs avx2)")
    older = {"quantization": {"file": quantization_sample.FILE, "sha256": "a" * 64}}  # before the isa was recorded
    assert "does not record the int8 instruction set it ran on (this CPU runs avx2)" in \
        quantization_sample.mismatch(older, "a" * 64, "avx2")
    # by default, this machine's
    record["quantization"]["isa"] = cpu_isa.int8_isa()
    assert quantization_sample.mismatch(record, "a" * 64) is None


def test_a_broken_line_is_refused_naming_it(tmp_path):
    quantization_sample.write(tmp_path, [MCQuestion("q?", ("a", "b"), answer=1)])
    with open(tmp_path / quantization_sample.FILE, "a") as f:
        f.write('{"question": "no options", "answer": "A"}\n')
    with pytest.raises(ValueError, match=r"quantization_sample.jsonl line 2 is not a question of the quantisation "
                                         r"sample: KeyError: 'options'"):
        quantization_sample.read(tmp_path)
