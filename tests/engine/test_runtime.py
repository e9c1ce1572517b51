"""ibedl.engine.runtime: which calibration a runtime serves with, asked of the backend that serves it."""

import copy
import shutil

import pytest

from ibedl.core import backends, cpu_isa, quantization_sample
from ibedl.core.artifact import read_manifest, write_manifest
from ibedl.core.predictor import Predictor
from ibedl.core.prompt import MCQuestion
from ibedl.engine.runtime import UncalibratedBackend, make_runtimes, switched
from ibedl.engine.settings import EngineSettings
from tests.core.test_backend_registry import EagerTrunk

SAMPLE = [MCQuestion("Which is sun?", ("sun", "moon"), context="The sun is a star.", answer=0),
          MCQuestion("Which is wet?", ("water", "sand", "dust"), answer=0)]


def test_a_registered_static_int8_backend_is_served_only_on_the_sample_its_calibration_records(tiny_artifact,
                                                                                              tmp_path, monkeypatch):
    """What makes a calibration hold only for the int8 trunk quantised on its recorded sample is that the backend
    declares ``static_int8``: one registered under another name is held to it (no name is tested)."""
    monkeypatch.setitem(backends.REGISTRY, "npu-int8", EagerTrunk("npu-int8", static_int8=True, calls=[]))
    artifact = tmp_path / "a"
    shutil.copytree(tiny_artifact, artifact)
    manifest = read_manifest(artifact)
    sections = copy.deepcopy({n: getattr(manifest, n) for n in ("abstention", "conformal", "calibration",
                                                                   "reference")})
    sections["calibration"]["quantization"] = {"file": quantization_sample.FILE, "isa": cpu_isa.int8_isa(),
                                               "sha256": quantization_sample.write(artifact, SAMPLE)}
    manifest.set_calibration("npu-int8", {}, sections)
    write_manifest(artifact, manifest)
    settings = EngineSettings(artifact=artifact, max_tokens=96)
    runtime = next(iter(make_runtimes(Predictor.from_artifacts([artifact]), settings).values()))
    assert runtime.calibration.key == "torch-fp32" and runtime.calibration_matches

    def trunk(batch):
        raise AssertionError("nothing is answered here")

    served = switched(runtime, "npu-int8", trunk, "named", None, artifact, settings)
    assert served.calibration.key == "npu-int8" and served.calibration_matches
    quantization_sample.write(artifact, SAMPLE[:1])  # the sample changed: a trunk quantised now is another one
    with pytest.raises(UncalibratedBackend, match="npu-int8 calibration does not hold for the int8 trunk served"):
        switched(runtime, "npu-int8", trunk, "named", None, artifact, settings)
    anyway = switched(runtime, "npu-int8", trunk, "named", None, artifact,
                      EngineSettings(artifact=artifact, max_tokens=96, allow_uncalibrated_backend=True))
    assert anyway.calibration.key == "npu-int8" and not anyway.calibration_matches
