"""The service serves the calibration made on the backend that runs: the matching one is applied (thresholds,
conformal quantiles, post-hoc parameter, drift reference) and reported; none matching is refused at startup with the
reason, unless IBEDL_ALLOW_UNCALIBRATED_BACKEND."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from ibedl.core import cpu_isa
from ibedl.core.artifact import read_manifest, write_manifest
from tests.serve.conftest import load_predictor, wait_status

Q = {"question": "Which is sun?", "options": ["sun", "moon", "tree", "bird"]}


def recalibrated(source, target, calibrated_on: str, others: dict[str, dict]):
    """A copy of ``source`` whose top-level calibration is recorded as made on ``calibrated_on``, with the
    ``backend_calibrations`` built by ``others`` (key -> changes to a copy of the top-level sections)."""
    shutil.copytree(source, target)
    manifest = read_manifest(target)
    manifest.calibrated_on = calibrated_on
    for key, change in others.items():
        sections = copy.deepcopy({name: getattr(manifest, name)
                                  for name in ("abstention", "conformal", "calibration", "reference")})
        for name, values in change.get("sections", {}).items():
            sections[name].update(values)
        manifest.set_calibration(key, change.get("head", {}), sections, change.get("metrics"))
    write_manifest(target, manifest)
    return target


@pytest.fixture
def cuda_calibrated(tiny_artifact, tmp_path):
    """The tiny artifact as if its only calibration had been made on CUDA in bfloat16."""
    return recalibrated(tiny_artifact, tmp_path / "cuda-only", "torch-cuda-bf16", {})


@pytest.fixture
def with_cpu_calibration(tiny_artifact, tmp_path):
    """Calibrated on CUDA at the top level and on torch-fp32 (the CPU tests' arithmetic) beside it, with
    thresholds that tell them apart: the CPU one abstains below confidence 0.999 and its zeta is 3."""
    return recalibrated(tiny_artifact, tmp_path / "both", "torch-cuda-bf16", {
        "torch-fp32": {"head": {"zeta": 3.0}, "sections": {"abstention": {"min_confidence": 0.999,
                                                                          "ood_threshold": 0.0},
                                                           "calibration": {"marker": "cpu"}},
                       "metrics": {"test": {"accuracy": 0.123}}}})


def test_a_backend_without_its_calibration_is_refused_with_the_reason(make_client, cuda_calibrated):
    with make_client(ready=False, artifact=cuda_calibrated, backend="torch") as c:
        body = wait_status(c, "failed")
        assert c.get("/health/ready").status_code == 503
        assert "carries no calibration made on backend torch (torch-fp32); it carries torch-cuda-bf16" in \
               body["reason"]
        assert "python -m ibedl.training.calibrate" in body["reason"]
        assert "IBEDL_ALLOW_UNCALIBRATED_BACKEND=true" in body["reason"]
        r = c.post("/predict", json=Q)
        assert r.status_code == 503 and "torch-fp32" in r.json()["error"]["message"]


def test_the_python_api_refuses_it_at_load(cuda_calibrated):
    import ibedl

    with pytest.raises(ValueError, match=r"carries no calibration made on backend torch \(torch-fp32\)"):
        ibedl.load(cuda_calibrated, backend="torch", max_tokens=96)


def test_the_override_serves_the_carried_calibration_and_says_so(make_client, cuda_calibrated, caplog):
    with (caplog.at_level("WARNING", logger="ibedl.engine"),
          make_client(artifact=cuda_calibrated, backend="torch", allow_uncalibrated_backend=True) as c):
        r = c.post("/predict", json=Q)
        assert r.status_code == 200, r.text
        assert r.json()["adapter"]["calibration"] == "torch-cuda-bf16"
        card = c.get("/v1/models").json()["data"][0]
    assert {k: v for k, v in card["calibration_in_use"].items() if k != "metrics"} == {
        "key": "torch-cuda-bf16", "backend_key": "torch-fp32", "matches_backend": False, "carried": ["torch-cuda-bf16"]}
    assert "its guarantees were made on other arithmetic" in caplog.text


def test_the_matching_calibration_is_applied_and_reported(make_client, with_cpu_calibration):
    with make_client(artifact=with_cpu_calibration, backend="torch") as c:
        r = c.post("/predict", json=Q)
        assert r.status_code == 200, r.text
        body = r.json()
        card = c.get("/v1/models").json()["data"][0]
        runtime = c.app.state.service.engine.default
    assert body["adapter"]["backend"] == "torch" and body["adapter"]["calibration"] == "torch-fp32"
    assert body["confidence"] < 0.999 and body["abstain_reason"] == "min_confidence"  # the CPU one's threshold
    assert card["backend"] == {"name": "torch", "requested": "torch", "reason": "named", "measured": None,
                               "forwards": None, "background": None}
    assert card["calibration_in_use"] == {"key": "torch-fp32", "backend_key": "torch-fp32", "matches_backend": True,
                                          "carried": ["torch-cuda-bf16", "torch-fp32"],
                                          "metrics": {"test": {"accuracy": 0.123}}}
    assert card["abstention"]["min_confidence"] == 0.999 and card["calibration"]["marker"] == "cpu"
    assert card["metrics"] == read_manifest(with_cpu_calibration).metrics  # the manifest's, as before
    assert card["head"]["zeta"] == 3.0
    assert runtime.predictor.head.config.zeta == 3.0  # the post-hoc parameter of that calibration is the head's


class FakeBackendTrunk:
    """Stands for an OpenVINO trunk: the torch decoder's hidden states, computed outside the predictor (so the
    predictor may drop its model), times 1.0 + 1e-3 (other arithmetic, other probabilities)."""

    def __init__(self, predictor) -> None:
        self.decoder = predictor.decoder

    def __call__(self, batch):
        out = self.decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        states = out.last_hidden_state
        return states[torch.arange(states.shape[0]), batch.last_index] * (1.0 + 1e-3)


def fake_backend_loader(settings):
    predictor = load_predictor(settings.model_copy(update={"backend": "torch"}))
    predictor.trunk, predictor.backend, predictor.backend_reason = FakeBackendTrunk(predictor), "openvino-bf16", "test"
    predictor.calibration = None  # looked up again for the backend now running
    return predictor


def test_a_backend_serves_its_own_calibration_and_drops_the_torch_model(make_client, tiny_artifact, tmp_path):
    art = recalibrated(tiny_artifact, tmp_path / "bf16", "torch-fp32", {
        "openvino-bf16": {"sections": {"abstention": {"min_confidence": 0.25}, "calibration": {"marker": "bf16"}}}})
    with make_client(loader=fake_backend_loader, artifact=art) as c:
        r = c.post("/predict", json=Q)
        assert r.status_code == 200, r.text
        card = c.get("/v1/models").json()["data"][0]
        predictor = c.app.state.service.engine.default.predictor
    assert r.json()["adapter"]["backend"] == "openvino-bf16" and r.json()["adapter"]["calibration"] == "openvino-bf16"
    assert card["calibration_in_use"]["key"] == "openvino-bf16" and card["calibration_in_use"]["matches_backend"]
    assert card["abstention"]["min_confidence"] == 0.25 and card["calibration"]["marker"] == "bf16"
    assert predictor.model is None and predictor.decoder is None  # the trunk answers alone
    assert predictor.device == torch.device("cpu") and predictor.calibration_key == "openvino-bf16"


def test_a_backend_without_its_calibration_is_refused_even_when_torch_has_one(make_client, tiny_artifact):
    with make_client(loader=fake_backend_loader, ready=False) as c:
        body = wait_status(c, "failed")
    assert "carries no calibration made on backend openvino-bf16 (openvino-bf16); it carries torch-fp32" in \
           body["reason"]


def int8_loader(sample_sha: str):
    """A loader whose trunk stands for static int8 quantised on a sample file of sha256 ``sample_sha``."""

    def load(settings):
        predictor = fake_backend_loader(settings)
        predictor.backend, predictor.quantized_on = "openvino-int8", sample_sha
        return predictor

    return load


@pytest.fixture
def int8_calibrated(tiny_artifact, tmp_path):
    """Calibrated on torch-fp32 and on an int8 trunk quantised on a sample of sha256 "a" * 64."""
    return recalibrated(tiny_artifact, tmp_path / "int8", "torch-fp32", {
        "openvino-int8": {"sections": {"calibration": {"marker": "int8", "quantization": {
            "sha256": "a" * 64, "isa": cpu_isa.int8_isa()}}}}})


def test_an_int8_calibration_is_served_with_the_trunk_quantised_on_its_sample(make_client, int8_calibrated):
    with make_client(loader=int8_loader("a" * 64), artifact=int8_calibrated) as c:
        r = c.post("/predict", json=Q)
        card = c.get("/v1/models").json()["data"][0]
    assert r.status_code == 200 and r.json()["adapter"]["calibration"] == "openvino-int8"
    assert card["calibration_in_use"]["matches_backend"] and card["calibration"]["marker"] == "int8"


def test_an_int8_calibration_made_on_another_quantisation_is_refused(make_client, int8_calibrated, caplog):
    with make_client(loader=int8_loader("b" * 64), artifact=int8_calibrated, ready=False) as c:
        body = wait_status(c, "failed")
    assert "its openvino-int8 calibration does not hold for the int8 trunk served: the calibration was made on a " \
           "trunk quantised on other questions than the artifact's quantization_sample.jsonl" in body["reason"]
    assert "IBEDL_ALLOW_UNCALIBRATED_BACKEND=true" in body["reason"] and "b" * 12 not in body["reason"]
    with (caplog.at_level("WARNING", logger="ibedl.engine"),
          make_client(loader=int8_loader("b" * 64), artifact=int8_calibrated, allow_uncalibrated_backend=True) as c):
        assert c.post("/predict", json=Q).status_code == 200
        card = c.get("/v1/models").json()["data"][0]
    assert card["calibration_in_use"]["key"] == "openvino-int8" and not card["calibration_in_use"]["matches_backend"]
    assert "does not hold for its trunk" in caplog.text


def other_int8_class() -> str:
    """An int8 instruction-set class this CPU does not run: what a calibration made on another machine records."""
    return next(name for _, name in cpu_isa.INT8_ISAS if name != cpu_isa.int8_isa())


@pytest.mark.parametrize("how", ["made_on_another_cpu", "served_under_a_cap"])
def test_an_int8_calibration_made_on_another_instruction_set_is_refused(make_client, tiny_artifact, tmp_path,
                                                                        monkeypatch, how):
    for cap in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(cap, raising=False)
    made_on = cpu_isa.int8_isa()
    if how == "made_on_another_cpu":  # e.g. calibrated on an AVX512-VNNI machine, served on this one
        made_on = other_int8_class()
    else:  # calibrated here, served as on a CPU of a lower int8 class (oneDNN's cap, which OpenVINO obeys)
        if made_on == "avx2":
            pytest.skip("this CPU's int8 class is avx2 already: no lower class to cap it to")
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE" if made_on != "avx512bw" else "AVX2")
        assert cpu_isa.int8_isa() != made_on
    artifact = recalibrated(tiny_artifact, tmp_path / "int8", "torch-fp32", {
        "openvino-int8": {"sections": {"calibration": {"marker": "int8", "quantization": {
            "sha256": "a" * 64, "isa": made_on}}}}})
    with make_client(loader=int8_loader("a" * 64), artifact=artifact, ready=False) as c:
        body = wait_status(c, "failed")
    assert "its openvino-int8 calibration does not hold for the int8 trunk served: the calibration was made on " \
           f"int8 arithmetic of another instruction set ({made_on}; this CPU runs {cpu_isa.int8_isa()})" in \
           body["reason"]


@pytest.mark.parametrize("made_on", ["same", "other"])
def test_a_bf16_calibration_is_served_only_on_the_bf16_class_it_was_made_on(make_client, tiny_artifact, tmp_path,
                                                                           monkeypatch, made_on):
    """AMX and AVX512-BF16 round bf16 differently: a calibration made on the other one does not hold here, and a
    named openvino-bf16 fails to load saying why (auto leaves the candidate out: tests/core/test_arithmetic.py)."""
    from ibedl.core import arithmetic

    monkeypatch.setattr(arithmetic, "bf16_isa", lambda: "amx-bf16")  # this CPU, whatever it is
    isa = "amx-bf16" if made_on == "same" else "avx512-bf16"
    art = recalibrated(tiny_artifact, tmp_path / "bf16", "torch-fp32", {
        "openvino-bf16": {"sections": {"calibration": {"marker": "bf16", "bf16": {"isa": isa}}}}})
    with make_client(loader=fake_backend_loader, artifact=art, ready=False) as c:
        body = wait_status(c, "ready" if made_on == "same" else "failed")
    if made_on == "other":
        assert "its openvino-bf16 calibration does not hold for the bfloat16 arithmetic served: the calibration was " \
               "made on bfloat16 arithmetic of another instruction set (avx512-bf16; this CPU runs amx-bf16)" in \
               body["reason"]
