"""benchmarks/gpu_serve_profile.py: its arguments, and one setting measured for real (on this CPU: the same engine
and accounting as on CUDA, without the synchronisation)."""

from __future__ import annotations

import cProfile
import re

import pytest

from benchmarks import gpu_serve_profile


def test_settings_are_parsed_and_bad_ones_refused_by_name():
    assert gpu_serve_profile.parse_settings("16:2048, 64:32768:loose,") == [(16, 2048, False), (64, 32768, True)]
    for text, message in (("64", "expected max_batch_size:max_batch_tokens[:loose], got '64'"), ("8:64:tight", "got"),
                          ("8:64:loose:x", "got '8:64:loose:x'"),
                          ("0:2048", "'0:2048' needs max_batch_size >= 1"), ("8:4", "max_batch_tokens >= 16"),
                          (" , ", "no setting given")):
        with pytest.raises(ValueError, match=re.escape(message)):
            gpu_serve_profile.parse_settings(text)


def test_bad_arguments_and_a_missing_artifact_are_refused_before_loading_anything(tmp_path, capsys):
    for argv, message in ((["--questions", "0"], "--questions must be >= 1, got 0"),
                          (["--settings", "x:y"], "got 'x:y'"),
                          (["--backends", "torch,tpu"], "unknown inference backend 'tpu'"),
                          (["--backends", "auto"], "name one or more backends (auto is a choice among them)"),
                          (["--backends", " , "], "got ' , '"),
                          (["--artifact", str(tmp_path)], "holds no manifest.json")):
        with pytest.raises(SystemExit) as exit_:
            gpu_serve_profile.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_without_cuda_it_exits_2_saying_why(monkeypatch, capsys, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_serve_profile.main(["--artifact", "artifacts/default", "--output", str(tmp_path / "p.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err and not (tmp_path / "p.json").exists()


@pytest.mark.integration
def test_one_setting_accounts_every_question_and_splits_the_time(monkeypatch):
    from ibedl.training.data import load_dataset
    from tests.conftest import shared_cache_dir

    monkeypatch.setenv("IBEDL_CACHE_DIR", shared_cache_dir())
    bodies = [{"question": q.question, "options": list(q.options), "context": q.context}
              for q in load_dataset("sciq", "train", limit=6, seed=0)]
    profile = cProfile.Profile()
    row = gpu_serve_profile.measure("artifacts/default", bodies, 3, 4096, profile, device="cpu")
    assert row["questions"] == 6 and 1 <= row["passes"] <= 6 and row["loose"] is False
    assert row["backend"] == "torch" and row["graph_counts"] is None  # torch as loaded: no graphs
    assert row["mean_pass_questions"] * row["passes"] == pytest.approx(6)  # every question in one pass
    assert 0 < row["trunk_forward_s"] <= row["predictor_s"] <= row["seconds"]
    assert row["answers_per_s"] == pytest.approx(6 / row["seconds"])
    assert row["engine_outside_predictor_s"] == pytest.approx(row["seconds"] - row["predictor_s"])
    assert profile.getstats()  # the passes ran under the profiler
    ops = row["one_pass_operators"]
    assert ops["operator_cpu_s"] > 0 and ops["kernel_s"] is None and ops["operator_calls"] > 0  # no GPU here
    assert any(op["name"] == "aten::linear" or "mm" in op["name"] for op in ops["top_by_cpu"])
    assert row["trunk_forwards"] >= row["passes"]  # a pass runs in one or more length groups
    # loose (the engine's pad_freely): one forward per pass, fewer forwards on these questions
    loose = gpu_serve_profile.measure("artifacts/default", bodies, 3, 4096, None, device="cpu", loose=True)
    assert loose["loose"] is True and loose["trunk_forwards"] == loose["passes"]
    assert loose["trunk_forwards"] < row["trunk_forwards"]


def test_kernel_time_is_summed_over_kernel_events_only(monkeypatch):
    """torch's profiler gives an operator's event its kernels' device time too: summing every event would count
    the kernels twice (torch's own table sums the CUDA-typed events)."""
    import contextlib
    from types import SimpleNamespace

    import torch
    from torch.autograd import DeviceType

    from benchmarks import common

    events = [SimpleNamespace(key="aten::mm", count=2, device_type=DeviceType.CPU, self_cpu_time_total=300.0,
                              self_device_time_total=1000.0),
              SimpleNamespace(key="sm90_gemm", count=2, device_type=DeviceType.CUDA, self_cpu_time_total=0.0,
                              self_device_time_total=1000.0),
              SimpleNamespace(key="user", count=1, device_type=DeviceType.CUDA, self_cpu_time_total=0.0,
                              self_device_time_total=5000.0, is_user_annotation=True)]

    @contextlib.contextmanager
    def fake_profile(activities):
        yield SimpleNamespace(key_averages=lambda: events)

    monkeypatch.setattr("torch.profiler.profile", fake_profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    got = common.operator_table(lambda: None, "cuda")
    assert got["kernel_s"] == pytest.approx(0.001) and got["operator_cpu_s"] == pytest.approx(0.0003)
    assert got["kernel_launches"] == 2 and got["operator_calls"] == 2
    assert common.operator_table(lambda: None, "cpu")["kernel_s"] is None
    del events[1].self_device_time_total  # a torch that does not say
    assert common.operator_table(lambda: None, "cuda")["kernel_s"] is None
