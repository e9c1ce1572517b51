"""benchmarks/omp_wait.py: two real child processes on the tiny adapter, one per OpenMP wait policy, paired batch by
batch, and its arguments refused by name."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import omp_wait


@pytest.mark.parametrize("argv, message", [
    (["--pairs", "0"], "--pairs must be >= 1, got 0"),
    (["--rounds", "1"], "--rounds must be >= 2, got 1"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
])
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        omp_wait.main(argv)
    assert message in capsys.readouterr().err


def test_a_real_run_times_both_policies_on_the_same_batches(tiny_artifact, tmp_path, monkeypatch):
    seen = []
    real = omp_wait.run_child
    monkeypatch.setattr(omp_wait, "run_child", lambda policy, args: seen.append(policy) or real(policy, args))
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the parent's own policy reaches neither child
    out = tmp_path / "omp.json"
    assert omp_wait.main(["--artifact", str(tiny_artifact), "--pairs", "2", "--rounds", "2", "--batch", "2",
                          "--dataset", "obqa", "--output", str(out)]) == 0
    assert seen == ["unset", "PASSIVE", "PASSIVE", "unset"]  # each pair alternates which goes first
    result = json.loads(out.read_text())
    for policy, seen_by_child in (("unset", None), ("PASSIVE", "PASSIVE")):
        assert [run["policy"] for run in result["runs"][policy]] == [seen_by_child] * 2  # as the child saw it
        assert all(len(run["seconds"]) == len(run["cpu_s"]) == 2 and min(run["seconds"]) > 0
                   for run in result["runs"][policy])
        assert result["mean_ms_a_batch"][policy] > 0
    ratio = result["passive_time_ratio"]
    assert len(ratio["pairs"]) == 2 and ratio["low"] <= ratio["mean"] <= ratio["high"]
    first = result["runs"]["PASSIVE"][0]["seconds"], result["runs"]["unset"][0]["seconds"]
    assert ratio["pairs"][0] == pytest.approx(sum(first[0]) / sum(first[1]))  # per pair, of the mean batch times
    assert result["cpu"]["cores"] >= 1 and min(result["torch_threads"]) >= 1


def test_the_child_is_given_the_policy_in_its_environment(monkeypatch):
    import subprocess

    envs = []

    def run(argv, env, **kwargs):
        envs.append(env.get("OMP_WAIT_POLICY"))
        return subprocess.CompletedProcess(argv, 0, '{"seconds": [1.0], "cpu_s": [1.0], "threads": 1}\n', "")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    args = argparse.Namespace(artifact="a", rounds=2, batch=1, dataset="sciq")
    assert omp_wait.run_child("unset", args)["threads"] == 1 and omp_wait.run_child("PASSIVE", args)
    assert envs == [None, "PASSIVE"]


@pytest.mark.parametrize("done, message", [
    ((1, "", "Traceback: no questions"), "the PASSIVE child exited with 1 and no result: .*no questions"),
    ((0, "", ""), "the PASSIVE child exited with 0 and no result"),
])
def test_a_child_without_a_result_is_an_error_that_says_so(monkeypatch, done, message):
    import subprocess

    code, out, err = done
    monkeypatch.setattr(subprocess, "run", lambda argv, **k: subprocess.CompletedProcess(argv, code, out, err))
    args = argparse.Namespace(artifact="a", rounds=2, batch=1, dataset="sciq")
    with pytest.raises(RuntimeError, match=message):
        omp_wait.run_child("PASSIVE", args)
