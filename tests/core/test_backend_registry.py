"""The backend registry: one module per backend declares it, one line of ``REGISTRY`` lists it, and a backend added
that way is accepted, built, keyed and served with no other edit."""

import importlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ibedl.core import backends
from ibedl.core.backends import REGISTRY, Built, openvino_ir
from ibedl.core.backends.openvino_ir import LastTokenTrunk
from ibedl.core.predictor import Predictor

MODULES = {"torch": "torch_eager", "openvino": "openvino_int8_weights", "openvino-fp32": "openvino_fp32",
           "openvino-bf16": "openvino_bf16", "openvino-int8": "openvino_int8", "torch-cuda-fp32": "torch_cuda_fp32",
           "torch-cuda-bf16": "torch_cuda_bf16", "torch-cuda-nf4-bf16": "torch_cuda_nf4",
           "torch-cuda-merged-fp32": "torch_cuda_merged_fp32", "torch-cuda-merged-bf16": "torch_cuda_merged_bf16",
           "torch-cuda-graphs-fp32": "torch_cuda_graphs_fp32", "torch-cuda-graphs-bf16": "torch_cuda_graphs_bf16"}


def test_each_backend_is_its_own_module_and_one_registry_line():
    assert list(REGISTRY) == list(MODULES) and (*MODULES, "auto") == backends.BACKENDS
    for name, module in MODULES.items():
        declared = importlib.import_module(f"ibedl.core.backends.{module}").BACKEND
        assert REGISTRY[name] is declared and declared.name == name
    assert [REGISTRY[n].precision for n in MODULES] == ["model", "f32", "f32", "bf16", "f32", "f32", "bf16", "bf16",
                                                        "f32", "bf16", "f32", "bf16"]
    with pytest.raises(ValueError, match="auto is a choice among backends"):
        backends.get("auto")
    with pytest.raises(ValueError, match="unknown inference backend 'tpu'"):
        backends.get("tpu")


def test_each_backend_declares_what_callers_ask_instead_of_its_name():
    declared = {n: (b.auto, b.build_cost, b.static_int8) for n, b in REGISTRY.items()}
    assert declared == {"torch": (True, 0, False), "openvino": (False, 2, False), "openvino-fp32": (True, 1, False),
                        "openvino-bf16": (True, 2, False), "openvino-int8": (True, 3, True),
                        "torch-cuda-fp32": (True, 1, False), "torch-cuda-bf16": (True, 1, False),
                        "torch-cuda-nf4-bf16": (True, 1, False), "torch-cuda-merged-fp32": (True, 1, False),
                        "torch-cuda-merged-bf16": (True, 1, False), "torch-cuda-graphs-fp32": (True, 1, False),
                        "torch-cuda-graphs-bf16": (True, 1, False)}
    assert backends.REFERENCE == "torch" and REGISTRY[backends.REFERENCE].build_cost == 0  # nothing to build
    # every calibration key belongs to the backends that compute it, and to no other: a CUDA key to torch as loaded
    # in that arithmetic and to the CUDA backend that loads it so (of_key: torch, listed first)
    for key, owners in [("torch-fp32", ["torch"]), ("torch-cuda-nf4-bf16", ["torch", "torch-cuda-nf4-bf16"]),
                        ("torch-cuda-bf16", ["torch", "torch-cuda-bf16"]), ("openvino", ["openvino"]),
                        ("openvino-fp32", ["openvino-fp32"]), ("openvino-int8", ["openvino-int8"]),
                        # a merged trunk's arithmetic is its own: torch as loaded never computes it
                        ("torch-cuda-merged-bf16", ["torch-cuda-merged-bf16"]),
                        ("torch-cuda-merged-fp32", ["torch-cuda-merged-fp32"]),
                        # so is a graphed one's (padded shapes, the causal mask alone)
                        ("torch-cuda-graphs-bf16", ["torch-cuda-graphs-bf16"]),
                        ("torch-cuda-graphs-fp32", ["torch-cuda-graphs-fp32"])]:
        assert backends.of_key(key) is REGISTRY[owners[0]]
        assert [n for n, b in REGISTRY.items() if b.owns_key(key)] == owners
    assert backends.of_key("torch") is None and backends.of_key("tpu-fp32") is None
    assert backends.of_key("torch-cuda-merged-fp16") is None and backends.of_key("torch-fp32-extra") is None
    with pytest.raises(ValueError, match="build_cost must be >= 1 \\(an IR is built\\), got 0"):
        openvino_ir.OpenVINOBackend("openvino-free", openvino_ir.FP32, build_cost=0)


@dataclass(frozen=True)
class EagerTrunk:
    """A backend a contributor might add: the torch decoder called through the trunk interface. Its name means
    nothing to the code: what it declares (``auto``, ``build_cost``, ``static_int8``) is what callers ask."""

    name: str = "eager-trunk"
    precision: str = "f32"
    calls: list = None  # batches its trunk ran
    auto: bool = False
    build_cost: int = 1
    static_int8: bool = False

    def calibration_key(self, device="cpu", dtype="float32", load_in_4bit=False) -> str:
        return self.name

    def owns_key(self, key: str) -> bool:
        return key == self.name

    def unavailable(self, predictor, artifact: Path) -> str | None:
        return None

    def build(self, predictor, artifact: Path, base_sha256: str, export: bool = True):
        trunk = LastTokenTrunk(predictor.decoder).eval()

        def run(batch):
            self.calls.append(batch.input_ids.shape[0])
            with torch.no_grad():
                return trunk(batch.input_ids, batch.attention_mask, batch.last_index)

        return run

    def export(self, predictor, artifact: Path, base_sha256: str, copy_model: bool = True) -> Path:
        raise ValueError("nothing to export")

    def quantized_on(self, artifact: Path) -> str | None:
        from ibedl.core import quantization_sample

        return quantization_sample.sha256(artifact) if self.static_int8 else None


def test_a_registered_backend_is_accepted_keyed_built_and_served(tiny_artifact, monkeypatch):
    from ibedl.core.prompt import MCQuestion
    from ibedl.engine.settings import EngineSettings

    backend = EagerTrunk(calls=[])
    monkeypatch.setitem(REGISTRY, "eager-trunk", backend)  # the one registry line
    assert EngineSettings(backend="eager-trunk").backend == "eager-trunk"
    assert backends.calibration_key("eager-trunk") == "eager-trunk"
    (predictor,) = Predictor.from_artifacts([tiny_artifact], backend="torch")
    question = MCQuestion("Which is sun?", ("sun", "moon", "tree"))
    reference = predictor.predict([question])[0]
    built = backends.build_trunk("eager-trunk", predictor, tiny_artifact, "sha")
    assert built == Built(built.trunk, "eager-trunk", "named", None, None) and callable(built.trunk)
    predictor.serve_on(built)
    assert predictor.backend == "eager-trunk" and predictor.calibration_key == "eager-trunk"
    served = predictor.predict([question])[0]
    assert backend.calls == [1]  # the new backend's trunk answered
    assert served.probs == pytest.approx(reference.probs, abs=1e-5)
