"""make gpu-check (benchmarks/gpu_check.py) refuses a machine without CUDA at once, saying why; its steps are checked
before anything runs. The check itself needs a lent GPU machine and never runs in CI."""

import pytest
import torch

from benchmarks import gpu_check


def test_without_cuda_it_exits_2_saying_why(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--output", str(tmp_path / "out.json")]) == 2
    err = capsys.readouterr().err
    assert "make gpu-check needs a GPU: no CUDA device" in err and "CI never runs it" in err
    assert not (tmp_path / "out.json").exists()


def test_unknown_steps_are_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--only", "train,warp"])
    assert exit_.value.code == 2 and "unknown steps ['warp']" in capsys.readouterr().err


def test_the_makefile_has_the_target():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    assert "gpu-check: setup-gpu" in text  # the GPU lock's venv (tests/test_lock.py checks the install)
    assert "$(GPU_VENV)/bin/python -m benchmarks.gpu_check" in text
