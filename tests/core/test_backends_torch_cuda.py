"""The CUDA torch backends (ibedl.core.backends.torch_cuda): on a CUDA device ``auto`` chooses among the arithmetics
the artifact carries calibrations for (``torch-cuda-fp32``, ``torch-cuda-bf16``, ``torch-cuda-nf4-bf16`` where
bitsandbytes imports, and the merged ``torch-cuda-merged-fp32`` and ``torch-cuda-merged-bf16``), and the one chosen is
served with the calibration made on it.

These run on the CPU: a predictor of the tiny model stands on a faked CUDA device (its ``device``, the GPU's name and
bfloat16 support, bitsandbytes are patched), and a trunk is loaded on the CPU in bfloat16 for its shape and
arithmetic. The test at the end runs on a real GPU only."""

from __future__ import annotations

import copy
import itertools
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ibedl.core import auto_backend, backends
from ibedl.core.artifact import read_manifest, write_manifest
from ibedl.core.backends import REGISTRY, Built, torch_cuda
from ibedl.core.backends.torch_cuda import TorchCudaBackend, TorchTrunk, load_trunk
from ibedl.core.base_model import resolve_model
from ibedl.core.predictor import Predictor
from ibedl.core.prompt import MCQuestion

CUDA = ["torch-cuda-fp32", "torch-cuda-bf16", "torch-cuda-nf4-bf16"]
MERGED = ["torch-cuda-merged-fp32", "torch-cuda-merged-bf16"]  # the adapter folded into the base's weights
QUESTIONS = [MCQuestion("Which is sun?", ("sun", "moon", "tree")),
             MCQuestion("Which is wet, of all the things one finds near the sea?", ("water", "sand")),
             MCQuestion("Pick one.", ("a", "b", "c", "d"), context="A short passage to read first.")]


def carrying(source: Path, target: Path, keys: list[str], zeta: dict[str, float] | None = None) -> Path:
    """A copy of ``source`` carrying calibrations for ``keys`` beside its own (torch-fp32), each a copy of its
    sections with the post-hoc parameter ``zeta[key]`` (default: the top level's)."""
    shutil.copytree(source, target)
    manifest = read_manifest(target)
    for key in keys:
        sections = copy.deepcopy({n: getattr(manifest, n) for n in ("abstention", "conformal", "calibration",
                                                                       "reference")})
        manifest.set_calibration(key, {"zeta": (zeta or {}).get(key, manifest.head["zeta"])}, sections)
    write_manifest(target, manifest)
    return target


@pytest.fixture
def on_cuda(monkeypatch):
    """Predictors stand on cuda:0 of an H200 with bfloat16; ``on_cuda(bitsandbytes=False, bf16=False)`` takes either
    away."""

    def install(bitsandbytes: bool = True, bf16: bool = True):
        monkeypatch.setattr(Predictor, "device", property(lambda self: torch.device("cuda", 0)))
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
        monkeypatch.setattr(torch_cuda, "has_bitsandbytes", lambda: bitsandbytes)

    return install


def loaded(artifact: Path, dtype: torch.dtype = torch.bfloat16) -> Predictor:
    """The artifact on torch in ``dtype`` (bfloat16: what a CUDA service loads by default)."""
    return Predictor.from_artifact(artifact, device="cpu", dtype=dtype, backend="torch")


class TestCalibrationKeys:
    @pytest.mark.parametrize(("device", "dtype", "load_in_4bit", "key"), [
        ("cpu", "float32", False, "torch-fp32"),
        ("cpu", torch.bfloat16, False, "torch-bf16"),
        ("cpu", "float16", False, "torch-fp16"),
        ("cpu", "bfloat16", True, "torch-nf4-bf16"),  # named though it cannot load (NF4 is CUDA only)
        ("cuda", "float32", False, "torch-cuda-fp32"),
        ("cuda", torch.bfloat16, False, "torch-cuda-bf16"),
        ("cuda:1", "float16", False, "torch-cuda-fp16"),
        ("cuda", "bfloat16", True, "torch-cuda-nf4-bf16"),
        ("cuda", torch.float32, True, "torch-cuda-nf4-fp32"),
        (torch.device("cuda", 0), "float16", True, "torch-cuda-nf4-fp16"),
    ])
    def test_torch_keys_every_device_dtype_and_4bit(self, device, dtype, load_in_4bit, key):
        assert backends.calibration_key("torch", device, dtype, load_in_4bit) == key

    def test_an_unknown_dtype_has_no_key(self):
        with pytest.raises(ValueError, match="no calibration key for dtype 'int8'"):
            backends.calibration_key("torch", "cuda", "int8")

    @pytest.mark.parametrize("name", CUDA)
    def test_a_cuda_backend_keys_its_own_arithmetic_whatever_the_model_was_loaded_in(self, name):
        backend = REGISTRY[name]
        assert backends.calibration_key("torch", "cuda", backend.dtype, backend.load_in_4bit) == name
        for loaded_as in [("cpu", "float32", False), ("cuda", "bfloat16", True), ("cuda:1", "float16", False)]:
            assert backends.calibration_key(name, *loaded_as) == name
        assert backends.of_key(name) is REGISTRY["torch"] and backend.owns_key(name)
        assert [n for n in CUDA if REGISTRY[n].owns_key(name)] == [name]

    @pytest.mark.parametrize("name", MERGED)
    def test_a_merged_backend_keys_an_arithmetic_of_its_own(self, name):
        """Torch as loaded never computes a merged trunk's numbers: its key belongs to the merged backend alone."""
        backend = REGISTRY[name]
        assert backend.merged and not backend.load_in_4bit
        for loaded_as in [("cpu", "float32", False), ("cuda", backend.dtype, False), ("cuda", "bfloat16", True)]:
            assert backends.calibration_key(name, *loaded_as) == name
        assert backends.of_key(name) is backend
        assert [n for n, b in REGISTRY.items() if b.owns_key(name)] == [name]

    def test_a_merged_backend_is_named_for_its_arithmetic_and_never_on_a_4bit_base(self):
        with pytest.raises(ValueError, match="arithmetic: 'torch-cuda-merged-bf16', got 'torch-cuda-bf16'"):
            TorchCudaBackend("torch-cuda-bf16", "bfloat16", merged=True)
        with pytest.raises(ValueError, match="'torch-cuda-merged-nf4-bf16': an adapter is not merged into a 4-bit"):
            TorchCudaBackend("torch-cuda-merged-nf4-bf16", "bfloat16", load_in_4bit=True, merged=True)
        with pytest.raises(ValueError, match="no calibration key for dtype 'int4'"):
            TorchCudaBackend("torch-cuda-merged-int4", "int4", merged=True)

    def test_a_cuda_backend_is_named_for_its_arithmetic(self):
        with pytest.raises(ValueError, match="named for its arithmetic: 'torch-cuda-bf16', got 'torch-cuda-fast'"):
            TorchCudaBackend("torch-cuda-fast", "bfloat16")
        with pytest.raises(ValueError, match="named for its arithmetic: 'torch-cuda-nf4-bf16', got 'torch-cuda-bf16'"):
            TorchCudaBackend("torch-cuda-bf16", "bfloat16", load_in_4bit=True)
        with pytest.raises(ValueError, match="no calibration key for dtype 'int4'"):
            TorchCudaBackend("torch-cuda-int4", "int4")
        with pytest.raises(ValueError, match="build_cost must be >= 1 \\(a model is loaded\\), got 0"):
            TorchCudaBackend("torch-cuda-fp32", "float32", build_cost=0)


class TestUnavailable:
    def test_on_the_cpu_each_says_why_and_refuses_to_build(self, tiny_artifact):
        predictor = loaded(tiny_artifact, torch.float32)
        for name in CUDA + MERGED:
            assert backends.unavailable(name, predictor, tiny_artifact) == "it runs on CUDA; this predictor is on cpu"
            with pytest.raises(ValueError, match=f"backend '{name}' cannot run here: it runs on CUDA"):
                backends.build_trunk(name, predictor, tiny_artifact, "sha")
            with pytest.raises(ValueError, match="nothing to export"):
                backends.export_ir(name, predictor, tiny_artifact, "sha")

    def test_on_cuda_nf4_needs_bitsandbytes_and_bf16_a_gpu_with_bfloat16(self, tiny_artifact, on_cuda):
        predictor = loaded(tiny_artifact)
        on_cuda()
        assert {n: backends.unavailable(n, predictor, tiny_artifact) for n in CUDA} == dict.fromkeys(CUDA)
        on_cuda(bitsandbytes=False)
        assert backends.unavailable("torch-cuda-nf4-bf16", predictor, tiny_artifact) == (
            "NF4 needs bitsandbytes, which does not import here (pip install -e '.[gpu]')")
        assert backends.unavailable("torch-cuda-bf16", predictor, tiny_artifact) is None
        on_cuda(bf16=False)  # a GPU before Ampere
        assert backends.unavailable("torch-cuda-bf16", predictor, tiny_artifact) == "NVIDIA H200 has no bfloat16"
        assert backends.unavailable("torch-cuda-nf4-bf16", predictor, tiny_artifact) == "NVIDIA H200 has no bfloat16"
        assert backends.unavailable("torch-cuda-fp32", predictor, tiny_artifact) is None

    @pytest.mark.parametrize("name", ["torch-cuda-bf16", *MERGED])
    def test_ensembles_and_mc_dropout_stay_on_torch_as_loaded(self, tiny_artifact, name):
        for heads, mc in ([object(), object()], 0), ([object()], 4):
            predictor = SimpleNamespace(device=torch.device("cuda"), heads=heads, mc_samples=mc)
            assert REGISTRY[name].unavailable(predictor, tiny_artifact) == (
                "MC-Dropout and ensembles run on torch as loaded")


class TestAutoOnCuda:
    def test_candidates_are_the_calibrated_cuda_arithmetics(self, tiny_artifact, tmp_path, on_cuda):
        artifact = carrying(tiny_artifact, tmp_path / "a", CUDA)
        predictor = loaded(artifact)  # bf16, as a CUDA service loads it: torch computes torch-cuda-bf16
        on_cuda()
        assert predictor.calibration_key == "torch-cuda-bf16"
        names, skipped = auto_backend.candidates(predictor, artifact, backends.unavailable)
        assert names == ["torch-cuda-fp32", "torch-cuda-nf4-bf16", "torch"]
        assert skipped["torch-cuda-bf16"] == "torch as loaded computes in its arithmetic (torch-cuda-bf16)"
        assert skipped["openvino-fp32"] == "the artifact carries no calibration made on it (openvino-fp32)"
        on_cuda(bitsandbytes=False)
        names, skipped = auto_backend.candidates(predictor, artifact, backends.unavailable)
        assert names == ["torch-cuda-fp32", "torch"] and "bitsandbytes" in skipped["torch-cuda-nf4-bf16"]

    def test_merged_arithmetics_are_timed_beside_the_one_loaded(self, tiny_artifact, tmp_path, on_cuda):
        """A merged trunk in the precision torch was loaded in is another arithmetic: timed, not skipped."""
        artifact = carrying(tiny_artifact, tmp_path / "a", ["torch-cuda-bf16", *MERGED])
        predictor = loaded(artifact)
        on_cuda()
        names, skipped = auto_backend.candidates(predictor, artifact, backends.unavailable)
        assert names == [*MERGED, "torch"]
        assert skipped["torch-cuda-bf16"] == "torch as loaded computes in its arithmetic (torch-cuda-bf16)"
        on_cuda(bf16=False)
        names, skipped = auto_backend.candidates(predictor, artifact, backends.unavailable)
        assert "torch-cuda-merged-fp32" in names and skipped["torch-cuda-merged-bf16"] == "NVIDIA H200 has no bfloat16"

    def test_a_model_loaded_in_fp32_times_bf16_against_it(self, tiny_artifact, tmp_path, on_cuda):
        artifact = carrying(tiny_artifact, tmp_path / "a", CUDA)
        predictor = loaded(artifact, torch.float32)
        on_cuda()
        names, skipped = auto_backend.candidates(predictor, artifact, backends.unavailable)
        assert names == ["torch-cuda-bf16", "torch-cuda-nf4-bf16", "torch"]
        assert skipped["torch-cuda-fp32"] == "torch as loaded computes in its arithmetic (torch-cuda-fp32)"

    def test_an_arithmetic_without_its_calibration_is_skipped(self, tiny_artifact, tmp_path, on_cuda):
        artifact = carrying(tiny_artifact, tmp_path / "a", ["torch-cuda-nf4-bf16"])
        predictor = loaded(artifact)
        on_cuda()
        names, skipped = auto_backend.candidates(predictor, artifact, backends.unavailable)
        assert names == ["torch-cuda-nf4-bf16"]  # not torch either: it is calibrated on the CPU only (torch-fp32)
        assert skipped["torch"] == "the artifact carries no calibration made on it (torch-cuda-bf16)"
        assert skipped["torch-cuda-fp32"] == "the artifact carries no calibration made on it (torch-cuda-fp32)"
        on_cuda(bitsandbytes=False)
        choice, trunk = auto_backend.choose(predictor, artifact, "base", lambda n: pytest.fail(f"built {n}"),
                                            backends.unavailable)
        assert choice.backend == "torch" and trunk is None and "torch-cuda-nf4-bf16: NF4 needs" in choice.reason

    def test_the_chosen_arithmetic_is_served_with_its_own_calibration(self, tiny_artifact, tmp_path, on_cuda,
                                                                     monkeypatch):
        zeta = {"torch-cuda-fp32": -1.0, "torch-cuda-bf16": -2.0, "torch-cuda-nf4-bf16": -3.0,
                "torch-cuda-merged-fp32": -4.0, "torch-cuda-merged-bf16": -5.0}
        artifact = carrying(tiny_artifact, tmp_path / "a", CUDA + MERGED, zeta)
        predictor = loaded(artifact)
        on_cuda()
        predictor.use_calibration()
        assert predictor.calibration.key == "torch-cuda-bf16" and predictor.head.config.zeta == -2.0
        seconds = {"torch": 1.0, "torch-cuda-fp32": 1.5, "torch-cuda-nf4-bf16": 0.6, "torch-cuda-merged-fp32": 0.9,
                   "torch-cuda-merged-bf16": 0.5}
        monkeypatch.setattr(auto_backend, "torch_hidden", lambda predictor, batch: "torch")
        monkeypatch.setattr(auto_backend, "time_call", lambda run: seconds[run()])
        built = []

        def build(name):
            built.append(name)
            return lambda batch: name  # stands for the trunk: answers with its name, what the clock reads

        choice, trunk = auto_backend.choose(predictor, artifact, "base", build, backends.unavailable)
        assert choice.backend == "torch-cuda-merged-bf16" and built == ["torch-cuda-fp32", "torch-cuda-nf4-bf16",
                                                                         *MERGED]
        assert choice.seconds == seconds and "2.00x torch" in choice.reason
        predictor.serve_on(Built(trunk, choice.backend, choice.reason, choice))
        predictor.use_calibration()
        assert predictor.calibration_key == predictor.calibration.key == "torch-cuda-merged-bf16"
        assert predictor.head.config.zeta == -5.0

    def test_a_measurement_is_cached_per_gpu(self, tiny_artifact, tmp_path, on_cuda, monkeypatch):
        artifact = carrying(tiny_artifact, tmp_path / "a", CUDA)
        predictor = loaded(artifact)
        names = ["torch-cuda-fp32", "torch"]
        on_cpu = auto_backend.choice_path(predictor, artifact, "base", names)
        assert auto_backend.gpu_signature(predictor.device) == ()  # a CPU's cached measurements keep their key
        on_cuda()
        h200 = auto_backend.choice_path(predictor, artifact, "base", names)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
        a100 = auto_backend.choice_path(predictor, artifact, "base", names)
        assert len({on_cpu, h200, a100}) == 3

    def test_a_timed_call_waits_for_the_gpu(self, monkeypatch):
        class OnCuda(torch.Tensor):
            is_cuda = True  # what a CUDA tensor says; its kernels may still be queued

        waited = []
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
        on_gpu = torch.zeros(2, 4).as_subclass(OnCuda)
        run_of = auto_backend.runner(SimpleNamespace(), batch="batch")
        assert run_of(lambda batch: on_gpu)() is on_gpu and waited == [on_gpu.device]
        assert run_of(lambda batch: torch.zeros(2, 4))().shape == (2, 4) and len(waited) == 1  # the CPU: no wait

    def test_the_background_build_loads_the_served_base_else_the_manifests(self, tiny_artifact, tmp_path, on_cuda,
                                                                          monkeypatch):
        predictor = loaded(tiny_artifact)
        on_cuda()
        calls = []
        monkeypatch.setattr(torch_cuda, "load_trunk", lambda *args: calls.append(args) or "trunk")
        assert backends.build_one("torch-cuda-nf4-bf16", predictor, tiny_artifact, "sha", export=False) == "trunk"
        ref = predictor.model.name_or_path
        member = tiny_artifact / predictor.manifest.members[0]
        assert calls == [(ref, "sha", member, torch.device("cuda", 0), "bfloat16", True, False)]
        backends.build_one("torch-cuda-merged-bf16", predictor, tiny_artifact, "sha")
        assert calls[-1] == (ref, "sha", member, torch.device("cuda", 0), "bfloat16", False, True)
        predictor.drop_model()  # the switcher's copy once a trunk serves: its model is gone
        backends.build_one("torch-cuda-fp32", predictor, tiny_artifact, "sha")
        assert calls[-1][0] == predictor.manifest.base_model_ref().ref and calls[-1][4:] == ("float32", False, False)


class TestTrunk:
    def test_a_trunk_answers_b_by_d_in_the_arithmetic_its_calibration_ran_on(self, tiny_artifact):
        """A bf16 trunk loaded on the CPU computes what the predictor loaded in bf16 (``calibrate --dtype bfloat16``)
        computes, bit for bit: (B, d) last-token states, one row per question, in bfloat16."""
        reference = loaded(tiny_artifact)
        sha = reference.manifest.base_model_ref().sha256
        adapter = tiny_artifact / reference.manifest.members[0]
        trunk = load_trunk(reference.model.name_or_path, sha, adapter, "cpu", "bfloat16", False)
        assert isinstance(trunk, TorchTrunk) and trunk.device == torch.device("cpu")
        batch = reference.encode(QUESTIONS)
        hidden = trunk(batch)
        d = reference.model.config.hidden_size
        assert hidden.shape == (len(QUESTIONS), d) and hidden.dtype == torch.bfloat16 and not hidden.requires_grad
        assert torch.equal(hidden, auto_backend.torch_hidden(reference, batch))
        reference.serve_on(Built(trunk, "torch-cuda-bf16"))  # the head reads its states as the model's own
        served = reference.predict(QUESTIONS)
        assert [len(p.probs) for p in served] == [3, 2, 4]
        assert [p.probs for p in served] == [p.probs for p in loaded(tiny_artifact).predict(QUESTIONS)]

    def test_a_merged_trunk_folds_the_adapter_into_the_weights(self, tiny_artifact):
        """No LoRA layer is left. In fp32 the states are the unmerged adapter's to fp32's rounding, and far from the
        base's without the adapter (the adapter matters to them); in bf16 merging loses nothing beyond bf16's own
        rounding: its states are as close to fp32's as the unmerged bf16 trunk's are."""
        reference = loaded(tiny_artifact, torch.float32)
        sha = reference.manifest.base_model_ref().sha256
        adapter = tiny_artifact / reference.manifest.members[0]
        batch = reference.encode(QUESTIONS)
        exact = auto_backend.torch_hidden(reference, batch)
        scale = exact.abs().max()
        with reference.model.disable_adapter(), torch.no_grad():
            bare = auto_backend.torch_hidden(reference, batch)
        off = {}
        for dtype, merged in itertools.product(("float32", "bfloat16"), (True, False)):
            trunk = load_trunk(reference.model.name_or_path, sha, adapter, "cpu", dtype, False, merged=merged)
            assert any("lora" in name for name, _ in trunk.model.named_modules()) is not merged
            hidden = trunk(batch)
            assert hidden.shape == exact.shape and hidden.dtype == getattr(torch, dtype)
            off[dtype, merged] = float((hidden.float() - exact).abs().max() / scale)
        assert off["float32", True] < 1e-5 and float((bare - exact).abs().max() / scale) > 100 * off["float32", True]
        assert off["bfloat16", True] < 2 * off["bfloat16", False] + 1e-3, off

    def test_an_adapter_is_not_merged_into_a_4bit_base(self, tiny_artifact):
        with pytest.raises(ValueError, match="not merged into a 4-bit base"):
            load_trunk("any", "0" * 64, tiny_artifact, "cpu", "bfloat16", True, merged=True)

    def test_other_base_weights_are_refused(self, tiny_artifact):
        ref = str(read_manifest(tiny_artifact).base_model_ref().ref)
        sha = resolve_model(ref).sha256
        with pytest.raises(ValueError, match=f"resolves to weights with sha256 {sha[:12]}, not the served ones"):
            load_trunk(ref, "0" * 64, tiny_artifact, "cpu", "bfloat16", False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="loads the trunk on a CUDA GPU")
@pytest.mark.parametrize("name", CUDA)
def test_on_a_gpu_each_trunk_computes_what_its_calibration_ran_on(tiny_artifact, name):
    backend = REGISTRY[name]
    if backend.load_in_4bit and not torch_cuda.has_bitsandbytes():
        pytest.skip("NF4 needs bitsandbytes")
    reference = Predictor.from_artifact(tiny_artifact, device="cuda", dtype=getattr(torch, backend.dtype),
                                        load_in_4bit=backend.load_in_4bit, backend="torch")
    assert reference.calibration_key == name
    predictor = Predictor.from_artifact(tiny_artifact, device="cuda", backend=name)
    assert predictor.calibration_key == name and predictor.trunk is not None
    batch = predictor.encode(QUESTIONS)
    hidden = auto_backend.runner(predictor, batch)(predictor.trunk)()
    assert hidden.shape == (len(QUESTIONS), predictor.model.config.hidden_size) and hidden.is_cuda
    assert torch.equal(hidden, auto_backend.torch_hidden(reference, batch))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="loads the trunk on a CUDA GPU")
@pytest.mark.parametrize("name", MERGED)
def test_on_a_gpu_a_merged_trunk_is_the_arithmetic_its_calibration_runs(tiny_artifact, name):
    """``calibrate --backend torch-cuda-merged-*`` answers through this backend's trunk: two loads compute the same
    states bit for bit, as close to the fp32 unmerged states as the unmerged trunk of the same precision is."""
    backend = REGISTRY[name]
    predictor = Predictor.from_artifact(tiny_artifact, device="cuda", backend=name)
    again = Predictor.from_artifact(tiny_artifact, device="cuda", backend=name)
    assert predictor.calibration_key == name and predictor.trunk is not None
    batch = predictor.encode(QUESTIONS)
    hidden = auto_backend.runner(predictor, batch)(predictor.trunk)()
    assert hidden.is_cuda and torch.equal(hidden, auto_backend.runner(again, batch)(again.trunk)())
    exact = auto_backend.torch_hidden(Predictor.from_artifact(tiny_artifact, device="cuda", dtype=torch.float32,
                                                              backend="torch"), batch).float()
    unmerged = auto_backend.torch_hidden(Predictor.from_artifact(tiny_artifact, device="cuda", backend="torch",
                                                                 dtype=getattr(torch, backend.dtype)), batch)
    off = {way: float((h.float() - exact).abs().max() / exact.abs().max())
           for way, h in (("merged", hidden), ("unmerged", unmerged))}
    assert off["merged"] <= 2 * off["unmerged"] + 1e-3, off  # (TF32 may round fp32's matmuls on CUDA alike)
