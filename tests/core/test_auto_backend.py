"""``auto`` chooses by measurement: the fastest calibrated candidate is kept and a slower one is not, whatever the
CPU's flags say; candidates are only backends the artifact carries a matching calibration for; the measurement is
cached per machine and adapter and read back at the next start, which builds nothing. Timings are injected (the
tests do not depend on this machine's speed); the real trunks are timed in tests/integration/test_backends_real.py."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from ibedl.core import auto_backend, backends, cpu_isa, quantization_sample
from ibedl.core.artifact import read_manifest, write_manifest
from ibedl.core.backends import openvino_ir
from ibedl.core.predictor import Predictor
from ibedl.core.prompt import MCQuestion
from tests.core.test_backend_registry import EagerTrunk

pytest.importorskip("openvino")

SAMPLE = [MCQuestion("Which is sun?", ("sun", "moon"), context="The sun is a star.", answer=0),
          MCQuestion("Which is wet?", ("water", "sand", "dust"), answer=0)]


def carrying(source, target, keys: list[str], sample: bool = True, record_sample: bool = True):
    """A copy of ``source`` carrying calibrations for ``keys`` beside its own (torch-fp32), and (``sample``) a
    quantisation sample that a static int8 backend's calibration records (``record_sample``) or not."""
    shutil.copytree(source, target)
    manifest = read_manifest(target)
    sha = quantization_sample.write(target, SAMPLE) if sample else None
    for key in keys:
        sections = copy.deepcopy({n: getattr(manifest, n) for n in ("abstention", "conformal", "calibration",
                                                                       "reference")})
        if backends.of_key(key).static_int8 and record_sample:
            sections["calibration"]["quantization"] = {"file": quantization_sample.FILE, "sha256": sha,
                                                       "isa": cpu_isa.int8_isa()}
        manifest.set_calibration(key, {}, sections)
    write_manifest(target, manifest)
    return target


class Named:
    """Stands for a compiled trunk: calling it returns its backend's name (what the injected clock reads)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, batch):
        return self.name


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """Injects per-backend seconds: ``timed(seconds)`` makes each candidate's batch take seconds[name]; returns
    (a build function, the backends it built since, in order)."""
    monkeypatch.setenv("IBEDL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(openvino_ir, "native_bf16", lambda: True)
    monkeypatch.setattr(openvino_ir, "has_nncf", lambda: True)
    monkeypatch.setattr(auto_backend, "torch_hidden", lambda predictor, batch: "torch")
    built: list[str] = []

    def build(name):
        built.append(name)
        return None if name == "torch" else Named(name)

    def install(seconds: dict[str, float]):
        built.clear()
        monkeypatch.setattr(auto_backend, "time_call", lambda run: seconds[run()])
        return build, built

    return install


def failing_for(build, broken: str, error: Exception):
    """``build``, except that building ``broken`` raises ``error``."""

    def failing(name):
        if name == broken:
            raise error
        return build(name)

    return failing


def load(artifact) -> Predictor:
    return Predictor.from_artifact(artifact, backend="torch")


ALL = ["openvino-int8", "openvino-bf16", "openvino-fp32"]
CUDA = ["torch-cuda-fp32", "torch-cuda-bf16", "torch-cuda-nf4-bf16", "torch-cuda-merged-fp32",
        "torch-cuda-merged-bf16", "torch-cuda-graphs-fp32", "torch-cuda-graphs-bf16"]  # candidates on CUDA
# (test_backends_torch_cuda, test_backends_cuda_graphs)


def test_the_fastest_calibrated_backend_is_chosen_and_a_slower_one_is_not(tiny_artifact, tmp_path, timed):
    predictor = load(carrying(tiny_artifact, tmp_path / "a", ALL))
    artifact = tmp_path / "a"
    # bf16 slower than fp32 (as on a CPU whose bf16 peak is half its fp32 one): the flags would pick bf16
    build, built = timed({"torch": 1.0, "openvino-fp32": 0.7, "openvino-bf16": 1.3, "openvino-int8": 0.4})
    choice, trunk = auto_backend.choose(predictor, artifact, "base", build, backends.unavailable)
    assert choice.backend == "openvino-int8" and trunk.name == "openvino-int8"
    assert choice.seconds == {"openvino-int8": 0.4, "openvino-bf16": 1.3, "openvino-fp32": 0.7, "torch": 1.0}
    assert "2.50x torch" in choice.reason and not choice.cached
    build, built = timed({"torch": 1.0, "openvino-fp32": 0.7, "openvino-bf16": 1.3, "openvino-int8": 0.9})
    choice, trunk = auto_backend.choose(predictor, artifact, "base", build, backends.unavailable)
    assert choice.backend == "openvino-fp32" and trunk.name == "openvino-fp32"  # not bf16, not int8
    build, built = timed({"torch": 0.5, "openvino-fp32": 0.7, "openvino-bf16": 1.3, "openvino-int8": 0.9})
    choice, trunk = auto_backend.choose(predictor, artifact, "base", build, backends.unavailable)
    assert choice.backend == "torch" and trunk is None  # OpenVINO slower than torch here: torch


def test_the_measurement_is_cached_and_read_back_without_building(tiny_artifact, tmp_path, timed):
    artifact = carrying(tiny_artifact, tmp_path / "a", ["openvino-fp32"])
    predictor = load(artifact)
    build, built = timed({})
    start, trunk = auto_backend.start_choice(predictor, artifact, "base", build, backends.unavailable)
    assert start.backend == "torch" and trunk is None and built == [] and start.pending == ["openvino-fp32"]
    assert "not measured on this machine yet" in start.reason
    assert "python -m ibedl.core.measure_backends" in start.reason
    build, built = timed({"torch": 1.0, "openvino-fp32": 0.5})
    first, _ = auto_backend.choose(predictor, artifact, "base", build, backends.unavailable)
    stored = json.loads(Path(first.path).read_text())
    assert stored["seconds"] == {"openvino-fp32": 0.5, "torch": 1.0} and stored["candidates"] == ["openvino-fp32",
                                                                                                  "torch"]
    build, built = timed({})  # timing again would fail: nothing is measured
    again, trunk = auto_backend.start_choice(predictor, artifact, "base", build, backends.unavailable)
    assert again.cached and again.backend == "openvino-fp32" and built == ["openvino-fp32"]  # only the choice built
    assert again.seconds == first.seconds and again.measured == first.measured and "earlier start" in again.reason
    assert again.pending == [] and auto_backend.age_s(again) >= 0
    Path(first.path).write_text("{not json")  # a damaged cache is not trusted: torch until measured again
    third, _ = auto_backend.start_choice(predictor, artifact, "base", build, backends.unavailable)
    assert not third.cached and third.backend == "torch" and third.pending == ["openvino-fp32"]


def test_the_cache_is_per_candidate_set_and_thread_count(tiny_artifact, tmp_path, timed, monkeypatch):
    artifact = carrying(tiny_artifact, tmp_path / "a", ["openvino-fp32"])
    predictor = load(artifact)
    path = auto_backend.choice_path(predictor, artifact, "base", ["openvino-fp32", "torch"])
    assert path != auto_backend.choice_path(predictor, artifact, "base", ["openvino-bf16", "openvino-fp32", "torch"])
    assert path != auto_backend.choice_path(predictor, artifact, "other-base", ["openvino-fp32", "torch"])
    threads = __import__("torch").get_num_threads()
    monkeypatch.setattr("torch.get_num_threads", lambda: threads + 1)
    assert path != auto_backend.choice_path(predictor, artifact, "base", ["openvino-fp32", "torch"])


def test_candidates_are_the_calibrated_backends_this_machine_runs(tiny_artifact, tmp_path, timed, monkeypatch):
    timed({})
    artifact = carrying(tiny_artifact, tmp_path / "a", ["openvino-fp32", "openvino-bf16", "openvino-int8"])
    predictor = load(artifact)
    names, skipped = auto_backend.candidates(predictor, artifact, backends.unavailable)
    assert names == ALL + ["torch"]
    assert skipped == {n: f"the artifact carries no calibration made on it ({n})" for n in CUDA}
    monkeypatch.setattr(openvino_ir, "native_bf16", lambda: False)
    names, skipped = auto_backend.candidates(predictor, artifact, backends.unavailable)
    assert "openvino-bf16" not in names and skipped["openvino-bf16"] == "this CPU has no native bfloat16"
    monkeypatch.setattr(openvino_ir, "has_nncf", lambda: False)  # no NNCF and no cached int8 IR
    names, skipped = auto_backend.candidates(predictor, artifact, backends.unavailable)
    assert names == ["openvino-fp32", "torch"] and "NNCF" in skipped["openvino-int8"]

    only_torch = carrying(tiny_artifact, tmp_path / "b", [])
    names, skipped = auto_backend.candidates(load(only_torch), only_torch, backends.unavailable)
    assert names == ["torch"]
    assert skipped["openvino-fp32"] == "the artifact carries no calibration made on it (openvino-fp32)"


def test_candidates_are_the_registered_backends_that_declare_auto(tiny_artifact, tmp_path, timed, monkeypatch):
    """auto's candidates come from the registry: a backend registered with ``auto`` is timed and can win, one
    without is never timed; the costliest build is listed first and built last. Its name decides nothing."""
    assert auto_backend.candidate_names() == ALL + CUDA + ["torch"]
    assert auto_backend.build_order(auto_backend.candidate_names()) == ["openvino-fp32", *CUDA, "openvino-bf16",
                                                                         "openvino-int8"]  # cheapest first
    monkeypatch.setitem(backends.REGISTRY, "npu-int4", EagerTrunk("npu-int4", auto=True, build_cost=4, calls=[]))
    monkeypatch.setitem(backends.REGISTRY, "npu-fp32", EagerTrunk("npu-fp32", auto=False, calls=[]))
    assert auto_backend.candidate_names() == ["npu-int4", *ALL, *CUDA, "torch"]
    assert auto_backend.build_order(auto_backend.candidate_names())[-1] == "npu-int4"
    artifact = carrying(tiny_artifact, tmp_path / "a", ["openvino-fp32", "npu-int4", "npu-fp32"])
    predictor = load(artifact)
    assert auto_backend.candidates(predictor, artifact, backends.unavailable)[0] == ["npu-int4", "openvino-fp32",
                                                                                     "torch"]
    build, built = timed({"torch": 1.0, "openvino-fp32": 0.5, "npu-int4": 0.2, "npu-fp32": 0.1})
    choice, trunk = auto_backend.choose(predictor, artifact, "base", build, backends.unavailable)
    assert choice.backend == trunk.name == "npu-int4" and built == ["npu-int4", "openvino-fp32"]
    assert "npu-fp32" not in choice.seconds  # calibrated and faster, but auto may not choose it


def test_a_registered_static_int8_backend_needs_the_sample_its_calibration_records(tiny_artifact, tmp_path, timed,
                                                                                   monkeypatch):
    """What makes ``openvino-int8`` need its quantisation sample is that it declares ``static_int8``: another
    backend registered with it is held to the same check."""
    timed({})
    monkeypatch.setitem(backends.REGISTRY, "npu-int8",
                        EagerTrunk("npu-int8", auto=True, build_cost=3, static_int8=True, calls=[]))
    unrecorded = carrying(tiny_artifact, tmp_path / "a", ["npu-int8"], record_sample=False)
    names, skipped = auto_backend.candidates(load(unrecorded), unrecorded, backends.unavailable)
    assert "npu-int8" not in names and "does not record the questions" in skipped["npu-int8"]
    recorded = carrying(tiny_artifact, tmp_path / "b", ["npu-int8"])
    assert "npu-int8" in auto_backend.candidates(load(recorded), recorded, backends.unavailable)[0]
    quantization_sample.write(recorded, SAMPLE[:1])  # the artifact's sample changed after its calibration
    names, skipped = auto_backend.candidates(load(recorded), recorded, backends.unavailable)
    assert "quantised on other questions" in skipped["npu-int8"]


def test_int8_is_a_candidate_only_with_the_sample_its_calibration_was_made_on(tiny_artifact, tmp_path, timed):
    timed({})
    unrecorded = carrying(tiny_artifact, tmp_path / "a", ["openvino-int8"], record_sample=False)
    names, skipped = auto_backend.candidates(load(unrecorded), unrecorded, backends.unavailable)
    assert "openvino-int8" not in names and "does not record the questions" in skipped["openvino-int8"]
    other = carrying(tiny_artifact, tmp_path / "b", ["openvino-int8"])
    quantization_sample.write(other, SAMPLE[:1])  # the artifact's sample changed after its calibration
    names, skipped = auto_backend.candidates(load(other), other, backends.unavailable)
    assert "quantised on other questions" in skipped["openvino-int8"]
    missing = carrying(tiny_artifact, tmp_path / "c", ["openvino-int8"])
    (missing / quantization_sample.FILE).unlink()
    names, skipped = auto_backend.candidates(load(missing), missing, backends.unavailable)
    assert "carries no quantization_sample.jsonl" in skipped["openvino-int8"]


def test_int8_calibrated_on_another_cpu_is_not_a_candidate_here(tiny_artifact, tmp_path, timed, monkeypatch):
    """On every CPU: a calibration recorded on another int8 class (made on another machine) is skipped, with both
    classes named."""
    for cap in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(cap, raising=False)
    timed({})
    here = cpu_isa.int8_isa()
    elsewhere = next(name for _, name in cpu_isa.INT8_ISAS if name != here)
    other = carrying(tiny_artifact, tmp_path / "a", ["openvino-int8"])
    manifest = read_manifest(other)
    manifest.backend_calibrations["openvino-int8"]["calibration"]["quantization"]["isa"] = elsewhere
    write_manifest(other, manifest)
    names, skipped = auto_backend.candidates(load(other), other, backends.unavailable)
    assert "openvino-int8" not in names
    assert f"another instruction set ({elsewhere}; this CPU runs {here})" in skipped["openvino-int8"]


def test_int8_is_not_a_candidate_on_another_int8_instruction_set(tiny_artifact, tmp_path, timed, monkeypatch):
    for cap in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):  # calibrated on this CPU as it is
        monkeypatch.delenv(cap, raising=False)
    if cpu_isa.int8_isa() == "avx2":
        pytest.skip("this CPU's int8 class is avx2 already: no other class to cap it to")
    timed({})
    made_here = carrying(tiny_artifact, tmp_path / "a", ["openvino-int8"])
    assert "openvino-int8" in auto_backend.candidates(load(made_here), made_here, backends.unavailable)[0]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # this CPU as an AVX2-only one
    names, skipped = auto_backend.candidates(load(made_here), made_here, backends.unavailable)
    assert "openvino-int8" not in names
    assert f"another instruction set ({cpu_isa.int8_isa(cap='')}; this CPU runs avx2)" in skipped["openvino-int8"]


def test_nothing_but_torch_falls_back_with_the_reasons(tiny_artifact, tmp_path, timed):
    build, built = timed({})
    artifact = carrying(tiny_artifact, tmp_path / "a", [])
    choice, trunk = auto_backend.choose(load(artifact), artifact, "base", build, backends.unavailable)
    assert choice.backend == "torch" and trunk is None and built == [] and choice.seconds == {}
    assert choice.reason.startswith("the fallback: openvino-int8: the artifact carries no calibration")


def test_build_trunk_gives_the_choice_the_predictor_serves_on(tiny_artifact, tmp_path, timed, monkeypatch, caplog):
    artifact = carrying(tiny_artifact, tmp_path / "a", ["openvino-fp32", "openvino-bf16"])
    predictor = load(artifact)
    build, built = timed({"torch": 1.0, "openvino-fp32": 0.5, "openvino-bf16": 0.8})
    exported = []

    def fake_build(name, *args, export=True):
        exported.append((name, export))
        return None if name == "torch" else Named(name)

    monkeypatch.setattr(backends, "_build", fake_build)
    with caplog.at_level("INFO", logger="ibedl.core.auto_backend"):
        built = auto_backend.build("auto", predictor, artifact, "base")  # nothing measured: torch, no build
    assert built.trunk is None and built.backend == "torch" and exported == []
    assert built.choice.pending == ["openvino-fp32", "openvino-bf16"]  # cheapest build first
    assert "openvino-fp32, openvino-bf16 not measured on this machine yet; serving torch meanwhile" in caplog.text
    auto_backend.choose(predictor, artifact, "base", build, backends.unavailable)
    with caplog.at_level("INFO", logger="ibedl.core.auto_backend"):
        built = auto_backend.build("auto", predictor, artifact, "base")
    assert built.trunk.name == built.backend == "openvino-fp32" and exported == [("openvino-fp32", False)]
    assert built.choice.seconds["openvino-bf16"] == 0.8
    assert "inference backend auto -> openvino-fp32 (the fastest calibrated backend on this machine" in caplog.text
    predictor.serve_on(built)
    assert predictor.backend == "openvino-fp32" and predictor.backend_choice is built.choice
    built = backends.build_trunk("openvino-bf16", predictor, artifact, "base")
    assert built.trunk.name == "openvino-bf16" and built.reason == "named" and exported[-1] == ("openvino-bf16", True)


def test_interleaved_seconds_alternates_the_candidates_and_keeps_medians():
    order = []
    seconds = {"a": iter([9.0, 1.0, 3.0, 2.0]), "b": iter([9.0, 5.0, 4.0, 30.0])}  # a warm-up, then three rounds

    def timer(run):
        name = run()
        order.append(name)
        return next(seconds[name])

    assert auto_backend.interleaved_seconds({"a": lambda: "a", "b": lambda: "b"}, rounds=3, timer=timer) == \
        {"a": 2.0, "b": 5.0}  # one slow call of b (30 s) does not decide
    assert order == ["a", "b"] * 4
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        auto_backend.interleaved_seconds({"a": lambda: None}, rounds=0)


def test_each_candidate_is_timed_against_the_fastest_so_far(timed):
    wins = []
    build, built = timed({"torch": 1.0, "x": 0.5, "y": 0.8, "z": 0.3})
    best, trunk, seconds, skipped = auto_backend.tournament(
        ["x", "y", "z"], build, lambda t: (lambda: t.name) if t else (lambda: "torch"), ("torch", None),
        on_win=lambda name, trunk: wins.append(name))
    assert best == trunk.name == "z" and wins == ["x", "z"] and skipped == {}
    assert seconds == {"torch": 1.0, "x": 0.5, "y": 0.8, "z": 0.3}


def test_a_candidate_that_cannot_be_built_is_skipped_and_the_choice_not_cached(tiny_artifact, tmp_path, timed):
    artifact = carrying(tiny_artifact, tmp_path / "a", ["openvino-fp32", "openvino-bf16"])
    predictor = load(artifact)
    build, built = timed({"torch": 1.0, "openvino-fp32": 0.5})
    failing = failing_for(build, "openvino-bf16", OSError("No space left on device"))
    choice, trunk = auto_backend.choose(predictor, artifact, "base", failing, backends.unavailable)
    assert choice.backend == "openvino-fp32" and trunk.name == "openvino-fp32"
    assert choice.skipped["openvino-bf16"] == "could not be built: OSError: No space left on device"
    assert not auto_backend.choice_path(predictor, artifact, "base", ALL[1:] + ["torch"]).exists()


def test_an_unwritable_cache_measures_at_every_start(tiny_artifact, tmp_path, timed, monkeypatch, caplog):
    artifact = carrying(tiny_artifact, tmp_path / "a", ["openvino-fp32"])
    predictor = load(artifact)
    (tmp_path / "readonly").write_text("a file where the cache directory would be")
    monkeypatch.setenv("IBEDL_CACHE_DIR", str(tmp_path / "readonly"))
    build, built = timed({"torch": 1.0, "openvino-fp32": 0.5})
    with caplog.at_level("WARNING", logger="ibedl.core.auto_backend"):
        choice, _ = auto_backend.choose(predictor, artifact, "base", build, backends.unavailable)
        again, _ = auto_backend.choose(predictor, artifact, "base", build, backends.unavailable)
    assert choice.backend == again.backend == "openvino-fp32" and not again.cached
    assert "could not cache the measurement" in caplog.text and "each start measures again" in caplog.text


def test_a_cached_choice_that_cannot_be_built_any_more_starts_on_torch(tiny_artifact, tmp_path, timed):
    artifact = carrying(tiny_artifact, tmp_path / "a", ["openvino-fp32"])
    predictor = load(artifact)
    build, built = timed({"torch": 1.0, "openvino-fp32": 0.5})
    auto_backend.choose(predictor, artifact, "base", build, backends.unavailable)  # cached: fp32
    gone = failing_for(build, "openvino-fp32", FileNotFoundError("its IR was deleted"))
    choice, trunk = auto_backend.start_choice(predictor, artifact, "base", gone, backends.unavailable)
    assert choice.backend == "torch" and trunk is None and not choice.cached and choice.pending == ["openvino-fp32"]


def test_measure_backends_build_of_a_backend_with_nothing_to_export_is_a_usage_error(tiny_artifact, capsys):
    from ibedl.core import measure_backends

    with pytest.raises(SystemExit) as stop:
        measure_backends.main(["--artifact", str(tiny_artifact), "--build", "torch-cuda-bf16"])
    assert stop.value.code == 2
    assert "--build torch-cuda-bf16: backend 'torch-cuda-bf16' loads the base model" in capsys.readouterr().err


def test_measure_backends_builds_times_and_caches_what_auto_then_serves(tiny_artifact, tmp_path, monkeypatch, capsys):
    """``python -m ibedl.core.measure_backends --artifact DIR`` on real trunks (the tiny model's torch and OpenVINO
    fp32, timed on this machine): it prints the choice of the faster, and the next ``auto`` load reads that
    measurement back, building nothing, and serves the same backend with its calibration (whichever won here)."""
    from ibedl.core import measure_backends

    monkeypatch.setenv("IBEDL_CACHE_DIR", str(tmp_path / "cache"))
    artifact = carrying(tiny_artifact, tmp_path / "a", ["openvino-fp32"], sample=False)
    measure_backends.main(["--artifact", str(artifact)])
    printed = json.loads(capsys.readouterr().out)
    seconds = printed["seconds"]
    assert set(seconds) == {"torch", "openvino-fp32"} and all(s > 0 for s in seconds.values())
    assert printed["backend"] == min(seconds, key=seconds.get) and not printed["cached"]
    assert Path(printed["path"]).is_file()
    served = Predictor.from_artifact(artifact, backend="auto")
    assert served.backend_choice.cached and served.backend_choice.seconds == seconds
    assert served.backend == printed["backend"] and served.backend_reason.startswith("the fastest calibrated backend")
    assert served.calibration.key == ("torch-fp32" if served.backend == "torch" else "openvino-fp32")
