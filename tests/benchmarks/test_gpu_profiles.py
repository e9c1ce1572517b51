"""make gpu-profiles (benchmarks/gpu_profiles.py): the GPU measurements beyond the check, the one most needed first,
within one budget. Each profile's command is run here with CUDA hidden (it must parse and refuse at once, saying
why); the runner's order, limits, skips and record run with small stand-in profiles."""

import importlib
import json
import shlex
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_profiles

ROOT = Path(__file__).resolve().parents[2]


def test_each_profile_parses_its_arguments_and_without_cuda_exits_2_saying_so(monkeypatch, capsys, tmp_path):
    """On a lent GPU they measure; here each refuses at once (the serve profile first asks for the CUDA calibration
    that make gpu-check writes)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name, (module, arguments) in gpu_profiles.PROFILES.items():
        if name == "service_bound":  # the host's bound: no CUDA in it (tests/benchmarks/test_service_bound.py)
            continue
        try:
            code = importlib.import_module(module).main([*arguments, "--output", str(tmp_path / name)])
        except SystemExit as e:  # argparse's refusal
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and ("cuda" in err.lower() or "make gpu-check" in err), (name, err)
        assert not (tmp_path / name).exists()


def test_the_makefile_target_runs_the_runner_with_its_budgets():
    text = (ROOT / "Makefile").read_text()
    recipe = text.split("\ngpu-profiles:\n", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ")
    command = shlex.split(recipe.strip())
    assert command[:3] == ["$(GPU_VENV)/bin/python", "-m", "benchmarks.gpu_profiles"]
    assert command[3:] == ["--budget-s", "$(GPU_PROFILES_S)", "--each-s", "$(GPU_PROFILE_S)", "--results-dir",
                           "$(GPU_PROFILES_DIR)"]
    assert "GPU_PROFILES_S ?= 300" in text and "GPU_PROFILE_S ?= 120" in text


def test_the_order_puts_the_open_bounds_first_and_outputs_follow_the_benchmarks_names():
    assert list(gpu_profiles.PROFILES)[:2] == ["gpu_serve_profile", "paper_scale_gpu_checkpointed"]
    assert gpu_profiles.output_name("gpu_serve_profile") == "gpu_serve_profile.json"
    assert gpu_profiles.output_name("paper_scale_gpu_checkpointed") == "paper_scale_gpu_checkpointed.json"
    # third: the host's own bound beside the check's serve round (the GPU's machine CPU, never the committed CPU file)
    assert list(gpu_profiles.PROFILES)[2] == "service_bound"
    assert gpu_profiles.output_name("service_bound") == "service_bound_gpu_host.json"
    from benchmarks.common import device_output

    for name in ("training_precision", "merged_adapter", "padding_cost", "gradient_checkpointing", "pass_overhead",
                 "check_threads"):
        assert gpu_profiles.output_name(name) == Path(device_output(name, "cuda")).name


STAND_INS = {
    "prof_ok": "import json, sys\nopen(sys.argv[sys.argv.index('--output') + 1], 'w').write(json.dumps({'ok': 1}))\n",
    "prof_fail": "import sys\nprint('error: no CUDA device', file=sys.stderr)\nsys.exit(2)\n",
    # writes its first size, then fails
    "prof_crash": "import sys\nopen(sys.argv[sys.argv.index('--output') + 1], 'w').write('{\"sizes\": [1]}')\n"
                  "raise SystemExit('CUDA out of memory at size 8')\n",
    # writes, then waits for ever: its limit must kill it
    "prof_hang": "import json, sys, threading\nopen(sys.argv[sys.argv.index('--output') + 1], 'w').write('{}')\n"
                 "threading.Event().wait()\n",
}


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    for module, code in STAND_INS.items():
        (tmp_path / f"{module}.py").write_text(code)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(gpu_profiles, "PROFILES", {
        "first": ("prof_ok", []), "failing": ("prof_fail", ["--device", "cuda"]), "hanging": ("prof_hang", []),
        "crashing": ("prof_crash", []), "last": ("prof_ok", [])})
    results = tmp_path / "results"
    results.mkdir()
    return results


def test_the_runner_runs_in_its_order_records_each_and_a_failure_does_not_stop_the_next(stand_ins):
    record = gpu_profiles.run(["last", "crashing", "hanging", "failing", "first"], stand_ins, budget_s=600, each_s=3)
    # PROFILES' order, not the given one
    assert list(record["profiles"]) == ["first", "failing", "hanging", "crashing", "last"]
    first, failing, hanging, crashing, last = record["profiles"].values()
    assert crashing["process_exit"] == 1 and crashing["wrote"] == str(stand_ins / "crashing_cuda.json")
    assert first["wrote"] == str(stand_ins / "first_cuda.json") and "error" not in first
    assert json.loads((stand_ins / "first_cuda.json").read_text()) == {"ok": 1}
    assert "exited 2" in failing["error"] and "wrote" not in failing
    assert hanging["stopped_by_budget"] == 3 and hanging["seconds"] >= 3  # killed at its limit
    assert last["wrote"] == str(stand_ins / "last_cuda.json")
    assert json.loads((stand_ins / "gpu_profiles.json").read_text()) == record  # on disk after each


def test_a_profile_is_not_started_with_too_little_budget_left_and_gets_what_is_left(stand_ins, monkeypatch):
    limits = []
    monkeypatch.setattr(gpu_profiles, "run_budgeted",
                        lambda command, budget_s, output: limits.append(budget_s) or {"error": "stand-in"})
    ticks = iter(range(0, 1000, 50))  # each reading of the clock 50 s later
    record = gpu_profiles.run(["first", "failing", "hanging"], stand_ins, budget_s=120, each_s=100,
                              clock=lambda: next(ticks))
    assert limits == [70]  # started at 50 of 120 s: 70 left, under its 100
    assert record["profiles"]["first"]["seconds"] == 50
    assert "under the 30 s a profile needs" in record["profiles"]["failing"]["skipped"]
    assert "skipped" in record["profiles"]["hanging"]


@pytest.mark.parametrize("argv, message", [
    (["--only", "gpu_serve_profile,warp"], "unknown profiles ['warp']"),
    (["--only", ","], "no profile named"),
    (["--budget-s", "0"], "--budget-s and --each-s must be > 0, got 0.0 and 120.0"),
])
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_profiles.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_it_exits_0_only_when_every_profile_wrote_its_whole_result(stand_ins):
    assert gpu_profiles.main(["--only", "first,last", "--results-dir", str(stand_ins)]) == 0
    assert gpu_profiles.main(["--only", "first,crashing", "--results-dir", str(stand_ins)]) == 1
    assert gpu_profiles.main(["--only", "failing", "--results-dir", str(stand_ins)]) == 1
