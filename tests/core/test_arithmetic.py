"""Whether a calibration holds for this CPU's arithmetic (ibedl.core.arithmetic): CPU bfloat16 by its instruction
set (AMX and AVX512-BF16 round differently), static int8 by its sample and class, every other backend always."""

from types import SimpleNamespace

import pytest

from ibedl.core import arithmetic, cpu_isa
from ibedl.core.backends import get


@pytest.mark.parametrize(("here", "recorded", "holds"), [
    ("amx-bf16", "avx512-bf16", False), ("avx512-bf16", "avx512-bf16", True), ("avx512-bf16", "amx-bf16", False),
    (None, "avx512-bf16", False),  # capped to no bf16: the backend is unavailable anyway, and said so
    ("amx-bf16", None, True),  # a calibration from before the class was recorded: its machine is not known
])
def test_a_bf16_calibration_holds_on_the_bf16_class_it_was_made_on(monkeypatch, here, recorded, holds):
    monkeypatch.setattr(arithmetic, "bf16_isa", lambda: here)
    record = {} if recorded is None else {"bf16": {"isa": recorded}}
    why = arithmetic.mismatch(get("openvino-bf16"), record, None)
    assert (why is None) == holds
    if not holds:
        assert f"({recorded}; this CPU runs {here or 'no native bfloat16'})" in why
    for other in ("openvino-fp32", "torch"):  # their numbers do not depend on it
        assert arithmetic.mismatch(get(other), record, None) is None


def test_what_a_calibration_made_here_records(monkeypatch):
    monkeypatch.setattr(arithmetic, "bf16_isa", lambda: "amx-bf16")
    assert arithmetic.made_on(get("openvino-bf16")) == {"bf16": {"isa": "amx-bf16"}}
    assert arithmetic.made_on(get("openvino-fp32")) == {} and arithmetic.made_on(get("torch")) == {}
    assert arithmetic.made_on(None) == {}


def test_static_int8_is_checked_by_its_sample(monkeypatch):
    record = {"quantization": {"sha256": "a" * 64, "isa": cpu_isa.int8_isa()}}
    assert arithmetic.mismatch(get("openvino-int8"), record, "a" * 64) is None
    assert "other questions" in arithmetic.mismatch(get("openvino-int8"), record, "b" * 64)


@pytest.mark.parametrize(("flags", "cap", "isa"), [
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "", "amx-bf16"),
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "avx512_core_bf16", "avx512-bf16"),  # AMX capped away
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "avx512_core_amx", "amx-bf16"),
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "avx2", None),
    ({"avx2", "avx512f", "avx512_bf16"}, "", "avx512-bf16"),
    ({"avx2", "avx512f"}, "", None),
])
def test_the_bf16_class_of_a_cpu(flags, cap, isa):
    assert cpu_isa.bf16_isa(flags, cap) == isa


def test_calibrate_records_the_class_it_computed_on_and_none_for_labels_sent_back(monkeypatch, tmp_path):
    import json

    from ibedl.training import calibrate

    monkeypatch.setattr(arithmetic, "bf16_isa", lambda: "amx-bf16")
    ran = SimpleNamespace(outputs=None, dataset="sciq")
    assert calibrate.arithmetic_made_on(ran, "openvino-bf16") == {"bf16": {"isa": "amx-bf16"}}
    assert calibrate.arithmetic_made_on(SimpleNamespace(outputs=None, dataset="feedback"), "openvino-bf16") == {}
    stored = tmp_path / "outputs.json"
    stored.write_text(json.dumps({"bf16_isa": "avx512-bf16"}))
    assert calibrate.arithmetic_made_on(SimpleNamespace(outputs=str(stored), dataset="sciq"), "openvino-bf16") == {
        "bf16": {"isa": "avx512-bf16"}}
    stored.write_text(json.dumps({}))  # made before the class was recorded: not known
    assert calibrate.arithmetic_made_on(SimpleNamespace(outputs=str(stored), dataset="sciq"), "openvino-bf16") == {}
    assert calibrate.arithmetic_made_on(ran, "openvino-fp32") == {}
