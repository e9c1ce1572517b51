"""The backend switch end to end on the real model: the int8 OpenVINO trunk answers like torch fp32, directly and
through the service (IBEDL_BACKEND)."""

import httpx
import pytest

from evidential.predictor import Predictor
from tests.conftest import ServiceProcess
from tests.integration.conftest import DEFAULT_ARTIFACT
from training.data import load_dataset

pytest.importorskip("openvino")


@pytest.fixture(scope="module")
def questions():
    return load_dataset("sciq", "validation", limit=8, seed=11)


@pytest.fixture(scope="module")
def reference(real_model_ref, questions):
    return Predictor.from_artifact(DEFAULT_ARTIFACT).predict(questions)


def test_openvino_int8_agrees_with_torch(reference, questions):
    served = Predictor.from_artifact(DEFAULT_ARTIFACT, backend="openvino").predict(questions)
    for a, b in zip(reference, served):
        assert a.letter == b.letter
        assert max(abs(x - y) for x, y in zip(a.probs, b.probs)) < 0.02
        assert abs(a.uncertainty - b.uncertainty) < 0.02
        assert sum(b.belief) + b.uncertainty == pytest.approx(1.0, abs=1e-5)  # the head is still ours


def test_service_serves_the_chosen_backend(reference, questions, tmp_path):
    proc = ServiceProcess(DEFAULT_ARTIFACT, {"IBEDL_BACKEND": "openvino"}, tmp_path / "service.log")
    try:
        proc.wait_ready()
        for q, ref in list(zip(questions, reference))[:3]:
            body = httpx.post(proc.url + "/predict", json={"question": q.question, "options": list(q.options),
                                                          "context": q.context}, timeout=60).json()
            assert body["prediction"]["letter"] == ref.letter
            assert body["uncertainty_mass"] == pytest.approx(ref.uncertainty, abs=0.02)
    finally:
        assert proc.stop() == 0, proc.log_text()


def test_service_refuses_an_unknown_backend(tmp_path):
    from pydantic import ValidationError

    from service.settings import Settings

    with pytest.raises(ValidationError, match="unknown inference backend 'fast'"):
        Settings(backend="fast")
