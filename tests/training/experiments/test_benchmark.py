"""The benchmark runner end to end on the tiny model: id, ood and noise experiments, resume, report."""

import json
import re

import pytest

from ibedl.core.cpu_isa import describe
from ibedl.training.experiments.benchmark import Run, expand, main, run_machine
from ibedl.training.finetune import staging_dir


@pytest.fixture
def bench_config(tmp_path, tiny_model_dir):
    config = {
        "name": "tiny",
        "train": {"base_model": str(tiny_model_dir), "max_tokens": 512, "eval_batch_size": 8,
                  "optim": {"max_steps": 2, "batch_size": 4}, "lora": {"targets": ["q_proj", "v_proj"]}},
        "methods": ["map", "mc_dropout", "ib_edl"],
        "method_params": {"mc_dropout": {"mc_samples": 2}, "ib_edl": {"num_samples": 2}},
        "seeds": [0],
        "sizes": {"default": {"train": 8, "validation": 8, "test": 6}},
        "experiments": [
            {"kind": "id", "datasets": ["sciq", "obqa"]},
            {"kind": "ood", "train": "obqa", "ood": ["arc_easy"]},
            {"kind": "noise", "datasets": ["arc_easy"], "fraction": 0.5},
        ],
    }
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path, config


def test_expand_grid(bench_config):
    _, config = bench_config
    runs = expand({**config, "seeds": [0, 1]})
    assert len(runs) == 4 * 3 * 2
    assert Run("id", "id", "sciq", "ib_edl", 1, ("sciq",)) in runs
    noise = [r for r in runs if r.kind == "noise"]
    assert all(r.label_noise == 0.5 and r.key.startswith("noise-arc_easy-noise0.5-") for r in noise)
    with pytest.raises(ValueError, match="unknown methods"):
        expand({**config, "methods": ["map", "nope"]})


def test_runner_end_to_end_and_resume(bench_config, tmp_path):
    path, config = bench_config
    # every kind of experiment and cell once: one id dataset (the ood experiment trains on it too)
    path.write_text(json.dumps({**config, "experiments": [{"kind": "id", "datasets": ["obqa"]},
                                                           *config["experiments"][1:]]}))
    runs_dir, results = tmp_path / "runs", tmp_path / "tiny-results.json"
    args = ["--config", str(path), "--runs-dir", str(runs_dir), "--results", str(results)]
    assert main(args) == 0
    data = json.loads(results.read_text())
    assert len(data) == 9
    # the ood cell reuses the id training run of OBQA: 2 trained datasets (OBQA, noisy ARC) x 2 trained methods
    assert len(list(runs_dir.glob("*/manifest.json"))) == 4
    by_key = {r["key"]: r for r in data}
    assert set(by_key["id-obqa-ib_edl-s0"]["metrics"]) >= {"accuracy", "ece", "nll", "brier", "aurc", "ece_35"}
    ood = by_key["ood-obqa-ib_edl-s0"]["metrics"]
    assert 0 <= ood["ood/arc_easy/auroc_mp"] <= 1 and 0 <= ood["ood/arc_easy/auroc_um"] <= 1
    assert "ood/arc_easy/auroc_um" not in by_key["ood-obqa-map-s0"]["metrics"]
    # MC-Dropout and the methods with a predictive fit (Laplace, MAP+TS) reuse the MAP training run
    assert not (runs_dir / "obqa-mc_dropout-s0").exists()
    assert (runs_dir / "obqa-map-s0" / "predictions-mc_dropout-obqa.json").is_file()
    manifest = json.loads((runs_dir / "arc_easy-noise0.5-map-s0" / "manifest.json").read_text())
    assert manifest["training"]["label_noise"] == 0.5
    # every speed names the machine it was measured on (this CPU here), and the report says so
    assert manifest["training"]["run"]["machine"] == describe()
    assert all(r["efficiency"]["train_machine"] == r["efficiency"]["test_machine"] == describe() for r in data)
    report = results.with_suffix(".md").read_text()
    assert "## Label noise (50% of training labels moved; clean test data)" in report
    assert (tmp_path / "tiny-results-plots" / "risk-coverage-obqa.png").is_file()
    assert f"Measured on (cells' training, test speeds): {describe()} (9, 9)." in report

    # every IB-EDL cell has its zeta-free row (the fitted zeta itself, or the predictions again where it is 0)
    assert all(r["metrics_without_posthoc"] for r in data if r["method"] == "ib_edl")
    assert not any(r["metrics_without_posthoc"] for r in data if r["method"] != "ib_edl")

    # Resume: nothing is retrained; a lost result is rebuilt from its cached predictions, and an IB-EDL set cached
    # without its zeta-free row (an older evaluate_run's) is drawn again.
    stamps = {p: p.stat().st_mtime for p in runs_dir.glob("*/manifest.json")}
    lost = ("noise-arc_easy-noise0.5-ib_edl-s0", "id-obqa-ib_edl-s0")
    results.write_text(json.dumps([r for r in data if r["key"] not in lost]))
    old = runs_dir / "obqa-ib_edl-s0" / "predictions-ib_edl-obqa.json"
    cached = json.loads(old.read_text())
    old.write_text(json.dumps({k: v for k, v in cached.items() if k != "without_posthoc"}))
    assert main(args) == 0
    assert json.loads(old.read_text())["without_posthoc"] == cached["without_posthoc"]
    again = json.loads(results.read_text())
    assert len(again) == 9
    assert {p: p.stat().st_mtime for p in runs_dir.glob("*/manifest.json")} == stamps
    rebuilt = {r["key"]: r for r in again}[lost[0]]  # its cached predictions intact: the same record
    assert rebuilt["metrics"] == by_key[lost[0]]["metrics"]


def test_an_interrupted_ensemble_run_restarts_from_its_saved_members(bench_config, tmp_path):
    path, config = bench_config
    small = {**config, "methods": ["ensemble"], "method_params": {"ensemble": {"members": 2}},
             "experiments": [{"kind": "id", "datasets": ["sciq"]}]}
    path.write_text(json.dumps(small))
    runs_dir, results = tmp_path / "runs", tmp_path / "ens.json"
    args = ["--config", str(path), "--runs-dir", str(runs_dir), "--results", str(results)]
    assert main(args) == 0
    first = json.loads(results.read_text())[0]
    run = runs_dir / "sciq-ensemble-s0"
    # killed while member 1 trained: what finetune wrote is still staged beside the run (member 0 saved, member 1
    # not), the run's directory holds no artifact, no predictions, only a stray file of the dead start
    stage = staging_dir(run)
    stage.mkdir()
    for name in ("members", "history.jsonl"):
        (run / name).rename(stage / name)
    for child in run.iterdir():
        child.unlink()
    (stage / "members" / "1" / "member.json").unlink()
    (run / "stray.tmp").write_text("x")
    results.unlink()
    kept = (stage / "members" / "0" / "adapter_model.safetensors").stat().st_mtime_ns
    assert main(args) == 0
    assert (run / "members" / "0" / "adapter_model.safetensors").stat().st_mtime_ns == kept
    assert not (run / "stray.tmp").exists() and (run / "members" / "1" / "member.json").is_file()
    assert "member 0: kept" in (run / "train.log").read_text()
    again = json.loads(results.read_text())[0]
    for metric in ("accuracy", "nll", "ece"):
        assert again["metrics"][metric] == pytest.approx(first["metrics"][metric], abs=1e-6)


def test_bad_config(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmethods: [map]\nseeds: [0]\nexperiments: [{kind: weird}]\n")
    assert main(["--config", str(bad)]) == 2
    assert "experiment kind must be id, ood or noise" in capsys.readouterr().err


def test_an_only_value_the_config_lacks_is_refused_with_the_choices(bench_config, tmp_path, capsys):
    path, _ = bench_config
    results, runs = tmp_path / "none.json", str(tmp_path / "runs")
    # the override written after --only-kinds: argparse reads it as a kind; it must not run the config's seeds
    assert main(["--config", str(path), "--results", str(results), "--runs-dir", runs, "--only-kinds", "id",
                 "seeds=[4]"]) == 2
    err = capsys.readouterr().err
    assert "--only-kinds: ['seeds=[4]'] not among this config's runs (['id', 'noise', 'ood'])" in err
    assert "key=value overrides go before the --only-* options" in err
    assert main(["--config", str(path), "--results", str(results), "--runs-dir", runs, "--only-methods", "map",
                 "vid"]) == 2
    err = capsys.readouterr().err
    assert "--only-methods: ['vid'] not among this config's runs (['ib_edl', 'map', 'mc_dropout'])" in err
    assert "overrides go before" not in err
    assert not results.exists()
    # written before the options, the override applies and the selection stands
    assert main(["--config", str(path), "--results", str(results), "--runs-dir", runs, "--dry-run",
                 "seeds=[4]", "--only-methods", "map", "--only-kinds", "id"]) == 0
    planned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("evaluate ")]
    assert [line.split()[1] for line in planned] == ["id-sciq-map-s4", "id-obqa-map-s4"]
    assert not results.exists()


def test_a_seeds_override_is_every_experiments_seeds(bench_config, tmp_path, capsys):
    """An experiment's own seeds are the file's default for it; the command line's 'seeds=[...]' wins over them
    (it used to run the experiment's own seeds, whatever seed the command named)."""
    path, config = bench_config
    config["experiments"][2]["seeds"] = [0, 1]
    path.write_text(json.dumps(config))
    argv = ["--config", str(path), "--results", str(tmp_path / "r.json"), "--runs-dir", str(tmp_path / "runs"),
            "--dry-run"]
    assert main([*argv, "--only-methods", "map", "--only-kinds", "noise"]) == 0
    planned = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("evaluate ")]
    assert planned == ["noise-arc_easy-noise0.5-map-s0", "noise-arc_easy-noise0.5-map-s1"]
    assert main([*argv, "seeds=[4]", "--only-methods", "map", "--only-kinds", "noise"]) == 0
    planned = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("evaluate ")]
    assert planned == ["noise-arc_easy-noise0.5-map-s4"]


def test_jobs_run_chains_side_by_side_with_the_same_results(bench_config, tmp_path):
    path, config = bench_config
    small = {**config, "methods": ["map", "ib_edl"], "experiments": [{"kind": "id", "datasets": ["sciq"]}]}
    path.write_text(json.dumps(small))
    records = {}
    for jobs in (1, 2):
        results = tmp_path / f"jobs{jobs}.json"
        assert main(["--config", str(path), "--runs-dir", str(tmp_path / f"runs{jobs}"), "--results", str(results),
                     "--jobs", str(jobs)]) == 0
        records[jobs] = {r["key"]: r for r in json.loads(results.read_text())}
    assert set(records[1]) == set(records[2]) == {"id-sciq-map-s0", "id-sciq-ib_edl-s0"}
    for key, record in records[1].items():
        for metric in ("accuracy", "nll", "ece"):  # one thread per job or torch's: the same runs up to rounding
            assert records[2][key]["metrics"][metric] == pytest.approx(record["metrics"][metric], abs=1e-3)


@pytest.mark.parametrize(("change", "says"), [
    ({"size": {"default": {"train": 8}}}, r"unknown keys \['size'\]; a benchmark config has"),  # read as no sizes
    ({"experiments": [{"kind": "id", "datasets": ["sciqq"]}]}, r"unknown datasets \['sciqq'\]"),
])
def test_a_config_typo_is_refused_before_anything_runs(bench_config, tmp_path, capsys, change, says):
    path, config = bench_config
    path.write_text(json.dumps({**config, **change}))
    assert main(["--config", str(path), "--runs-dir", str(tmp_path / "runs"), "--dry-run"]) == 2
    assert re.search(says, capsys.readouterr().err)
    assert not (tmp_path / "runs").exists()


def test_a_failed_cell_fails_the_grid_and_a_failed_training_is_not_tried_again(bench_config, tmp_path, capsys,
                                                                               monkeypatch):
    """Any error of a cell is logged and the grid goes on, then exits 1 naming it (an error other than RuntimeError
    killed its worker and the grid exited 0); a failed training fails the rest of its chain without another try."""
    from ibedl.training.experiments import benchmark

    path, config = bench_config
    path.write_text(json.dumps({**config, "methods": ["map", "mc_dropout", "ib_edl"],
                                "experiments": [{"kind": "id", "datasets": ["sciq"]}]}))
    trained = []

    def run(self, cell):
        if cell.method == "ib_edl":
            raise json.JSONDecodeError("corrupt predictions", "", 0)  # not a RuntimeError
        trained.append(cell.key)
        raise benchmark.TrainingFailed("training sciq-map-s0 failed with 1")

    monkeypatch.setattr(benchmark.Runner, "run", run)
    assert main(["--config", str(path), "--runs-dir", str(tmp_path / "runs"),
                 "--results", str(tmp_path / "r.json")]) == 1
    err = capsys.readouterr().err
    assert "3 of 3 cells failed" in err and "id-sciq-ib_edl-s0" in err and "run the same command again" in err
    assert trained == ["id-sciq-map-s0"]  # MC-Dropout shares MAP's training: not tried again


def test_bad_jobs(bench_config, capsys):
    path, _ = bench_config
    with pytest.raises(SystemExit):
        main(["--config", str(path), "--jobs", "0"])
    assert "must be >= 1, got 0" in capsys.readouterr().err


def test_summarise_run_matches_option_counts():
    from sklearn.metrics import roc_auc_score

    from ibedl.training.experiments.evaluate_run import summarise_run

    id_probs = [[0.7, 0.1, 0.1, 0.1], [0.5, 0.2, 0.2, 0.1], [0.9, 0.05, 0.03, 0.02]] * 4
    ood_probs = [[0.6, 0.2, 0.1, 0.1], [0.3, 0.3, 0.2, 0.2]] * 6 + [[0.2] * 5] * 6  # 5-option ones: least confident
    preds = {"sets": {
        "sciq": {"probs": id_probs, "labels": [0] * 12, "uncertainty": [0.1, 0.3, 0.05] * 4},
        "arc_easy": {"probs": ood_probs, "labels": [0] * 18, "uncertainty": [0.2, 0.5] * 6 + [0.9] * 6},
    }}
    out = summarise_run(preds, ["sciq", "arc_easy"])
    conf_id, conf_ood = [max(p) for p in id_probs], [max(p) for p in ood_probs]
    auroc = lambda pos, neg: roc_auc_score([1] * len(pos) + [0] * len(neg), pos + neg)  # noqa: E731
    assert out["ood/arc_easy/auroc_mp"] == pytest.approx(auroc(conf_id, conf_ood))
    assert out["ood/arc_easy/auroc_mp_matched"] == pytest.approx(auroc(conf_id, conf_ood[:12]))
    # the 5-option questions were easy to reject
    assert out["ood/arc_easy/auroc_mp_matched"] < out["ood/arc_easy/auroc_mp"]
    assert out["ood/arc_easy/auroc_um_matched"] == pytest.approx(auroc([-0.1, -0.3, -0.05] * 4, [-0.2, -0.5] * 6))
    assert out["ood/arc_easy/matched_options"] == 4 and out["ood/arc_easy/matched_n"] == 12


def test_summarise_run_reports_sigma_against_the_evidence_and_as_an_ood_score():
    from scipy.stats import spearmanr
    from sklearn.metrics import roc_auc_score

    from ibedl.training.experiments.evaluate_run import summarise_run

    u_id, u_ood = [0.1, 0.3, 0.05, 0.2] * 3, [0.4, 0.5, 0.3] * 4
    sigma_id, sigma_ood = [2.0, 1.0, 3.0, 1.0] * 3, [0.9, 0.5, 1.5] * 4
    preds = {"sets": {
        "sciq": {"probs": [[0.7, 0.3]] * 12, "labels": [0] * 12, "uncertainty": u_id, "sigma": sigma_id},
        "obqa": {"probs": [[0.6, 0.4]] * 12, "labels": [0] * 12, "uncertainty": u_ood, "sigma": sigma_ood},
    }}
    out = summarise_run(preds, ["sciq", "obqa"])
    assert out["sigma/spearman_inv_u"] == pytest.approx(spearmanr(sigma_id, [1 / u for u in u_id]).statistic)
    assert out["ood/obqa/auroc_sigma"] == pytest.approx(roc_auc_score([1] * 12 + [0] * 12, sigma_id + sigma_ood))
    assert out["ood/obqa/sigma_spearman_inv_u"] == pytest.approx(
        spearmanr(sigma_ood, [1 / u for u in u_ood]).statistic)


def test_eval_set_variants():
    from ibedl.training.experiments.evaluate_run import load_eval_set

    plain = load_eval_set("sciq", 5)
    bare = load_eval_set("sciq:no_context", 5)
    assert [q.question for q in bare] == [q.question for q in plain]
    assert any(q.context for q in plain) and all(q.context is None for q in bare)  # some SciQ questions have none
    with pytest.raises(ValueError, match="unknown dataset variant 'shuffled' in 'sciq:shuffled'"):
        load_eval_set("sciq:shuffled", 5)


def test_without_posthoc_swaps_in_the_predictions_with_zeta_undone():
    from ibedl.training.experiments.evaluate_run import without_posthoc

    served = {"probs": [[0.6, 0.4]], "labels": [0], "uncertainty": [0.3], "samples_per_s": 9.0,
              "without_posthoc": {"probs": [[0.8, 0.2]], "uncertainty": [0.1]}}
    bare = without_posthoc({"sets": {"sciq": served}})
    assert bare["sets"]["sciq"]["probs"] == [[0.8, 0.2]] and bare["sets"]["sciq"]["uncertainty"] == [0.1]
    assert bare["sets"]["sciq"]["labels"] == [0]
    assert without_posthoc({"sets": {"sciq": {k: v for k, v in served.items() if k != "without_posthoc"}}}) is None


def test_cached_predictions_of_another_size_or_parameters_are_redone(bench_config, tmp_path):
    path, config = bench_config
    small = {**config, "methods": ["map", "mc_dropout"], "experiments": [{"kind": "id", "datasets": ["sciq"]}]}
    path.write_text(json.dumps(small))
    results = tmp_path / "r.json"
    args = ["--config", str(path), "--runs-dir", str(tmp_path / "runs"), "--results", str(results)]
    assert main(args) == 0
    cache = tmp_path / "runs" / "sciq-map-s0" / "predictions-mc_dropout-sciq.json"
    found = json.loads(cache.read_text())
    assert found["limit"] == 6 and len(found["probs"]) == 6 and found["method_params"] == {"mc_samples": 2}
    results.unlink()  # the cells are done again, with 4 test questions: the 6-question predictions are not reused
    assert main([*args, "sizes.default.test=4"]) == 0
    assert len(json.loads(cache.read_text())["probs"]) == 4
    results.unlink()  # other method parameters: evaluated again too
    assert main([*args, "sizes.default.test=4", "method_params.mc_dropout.mc_samples=3"]) == 0
    assert json.loads(cache.read_text())["method_params"] == {"mc_samples": 3}


def test_runner_records_what_laplaces_post_hoc_step_chose(bench_config, tmp_path):
    path, config = bench_config
    config = {**config, "methods": ["map", "laplace"], "method_params": {"laplace": {"fit_samples": 8}},
              "experiments": [{"kind": "id", "datasets": ["sciq"]}, {"kind": "ood", "train": "sciq", "ood": ["obqa"]}]}
    path.write_text(json.dumps(config))
    runs_dir, results = tmp_path / "runs", tmp_path / "tiny-results.json"
    assert main(["--config", str(path), "--runs-dir", str(runs_dir), "--results", str(results)]) == 0
    by_key = {r["key"]: r for r in json.loads(results.read_text())}
    assert "posthoc" not in by_key["id-sciq-map-s0"]
    [own] = by_key["id-sciq-laplace-s0"]["posthoc"]
    assert own["sets"] == ["sciq"] and own["prior"] == "validation" and own["prior_precision"] > 0
    assert own["validation_questions"] == 8 and own["fit_questions"] == 8 and own["fit_seconds"] > 0
    assert own["at_grid_edge"] in (None, "top", "bottom")
    # one fit for the run: the id cell's evaluation drew the ood cell's OBQA predictions too (Runner.plan)
    [shared] = by_key["ood-sciq-laplace-s0"]["posthoc"]
    assert shared == {**own, "sets": ["sciq", "obqa"]}  # fit_seconds too: the same fit
    assert not (runs_dir / "sciq-laplace-s0").exists()  # fitted on MAP's run


def test_a_config_can_start_from_another(tmp_path):
    from ibedl.training.experiments.benchmark import load_benchmark_config

    (tmp_path / "grid.yaml").write_text(
        "name: grid\nmethods: [map, ib_edl]\nseeds: [0, 1]\n"
        "method_params:\n  ib_edl: {beta: 1.0e-5, risk: nll}\n  ensemble: {members: 3}\n"
        "search:\n  candidates: {map: [{optim.head_lr: 1.0e-3}]}\n")
    (tmp_path / "ablation.yaml").write_text(
        f"name: ablation\nbase: {tmp_path / 'grid.yaml'}\nmethods: [ib_edl]\n"
        "method_params:\n  ib_edl: {sigma_constant: 0.5}\n")
    config = load_benchmark_config(tmp_path / "ablation.yaml", ["seeds=[2]"])
    assert config["name"] == "ablation" and config["methods"] == ["ib_edl"] and config["seeds"] == [2]
    assert config["method_params"] == {"ib_edl": {"beta": 1e-5, "risk": "nll", "sigma_constant": 0.5},
                                       "ensemble": {"members": 3}}
    assert "search" not in config and "base" not in config


def test_training_summary_reads_start_end_and_zeta_from_the_manifest():
    from ibedl.training.experiments.benchmark import training_summary

    def member(acc_start, acc_end, stopped):
        start = {"accuracy": acc_start, "mean_confidence": 0.7, "ece": 0.2, "nll": 0.6, "brier": 0.3}
        end = {**start, "accuracy": acc_end, "nll": 0.4}
        return {"validation_start": start, "validation_end": end, "stopped_step": stopped, "best_step": stopped - 76,
                "budget_steps": 760, "stopped_by": "patience"}

    ensemble = {"training": {"run": {"members": [member(0.5, 0.7, 152), member(0.5, 0.9, 228)]}, "zeta": None},
                "metrics": {"validation": {"ece": 0.1}}}
    summary = training_summary(ensemble)
    assert summary["validation_start"]["accuracy"] == 0.5
    assert summary["validation_end"]["accuracy"] == pytest.approx(0.8)
    assert summary["steps"] == [152, 228] and summary["best_steps"] == [76, 152] and summary["budget_steps"] == 760
    assert summary["stopped_by"] == ["patience", "patience"] and summary["zeta"] is None
    single = {"training": {"run": member(0.6, 0.8, 100), "zeta": {"zeta": -2.0}},
              "metrics": {"validation": {"ece": 0.05}}}
    summary = training_summary(single)
    assert summary["validation_end"]["accuracy"] == 0.8 and summary["zeta"] == {"zeta": -2.0}
    assert summary["validation_after_posthoc"] == {"ece": 0.05}
    # a run recorded before start and end metrics existed
    assert training_summary({"training": {"run": {"steps": 38}}})["validation_start"] is None


def test_train_data_adds_keys_the_cells_do_not_set(bench_config, tmp_path):
    from ibedl.training.experiments.benchmark import train_overrides

    _, config = bench_config
    run = Run("noise", "noise", "sciq", "map", 1, ("sciq",), 0.3)
    with_start = {**config, "train": {**config["train"], "data": {"disjoint_from": "artifacts/map"}}}
    data = next(json.loads(o.split("=", 1)[1]) for o in train_overrides(with_start, run, "map", tmp_path)
                if o.startswith("data="))
    assert data["disjoint_from"] == "artifacts/map"
    assert data["train"] == [{"dataset": "sciq", "limit": 8}] and data["label_noise"] == 0.3 and data["noise_seed"] == 1
    plain = train_overrides(config, run, "map", tmp_path)
    assert not any(o.startswith("data=") and "disjoint_from" in o for o in plain)
    clash = {**config, "train": {**config["train"], "data": {"label_noise": 0.5}}}
    with pytest.raises(ValueError, match="train.data may only add keys .* got \\{'label_noise': 0.5\\}"):
        train_overrides(clash, run, "map", tmp_path)


def test_an_ensemble_is_offered_maps_run_of_its_seed_once_it_has_trained(bench_config, tmp_path):
    from ibedl.training.experiments.benchmark import train_overrides

    _, config = bench_config
    run = Run("noise", "noise", "sciq", "ensemble", 1, ("sciq",), 0.3)
    out = tmp_path / run.train_key("ensemble")

    def members_from():
        found = [o for o in train_overrides(config, run, "ensemble", out) if o.startswith("members_from=")]
        return json.loads(found[0].split("=", 1)[1]) if found else None

    assert members_from() is None  # MAP's run of this seed has not trained yet
    donor = tmp_path / "sciq-noise0.3-map-s1"
    donor.mkdir()
    assert members_from() is None  # nor saved its adapter: finetune would have nothing to check
    (donor / "member.json").write_text("{}")
    assert members_from() == [str(donor)]
    assert not any(o.startswith("members_from=") for o in train_overrides(config, run, "map", tmp_path / "m"))


def test_the_validation_passes_made_while_training_are_kept_in_the_summary(tmp_path):
    from ibedl.training.experiments.benchmark import training_summary, validation_trajectory

    history = tmp_path / "history.jsonl"
    assert validation_trajectory(history) == []  # no history: nothing, not an error
    rows = [{"member": 0, "step": s, "loss": 0.5} for s in range(1, 151)]
    for row, nll in ((rows[74], 0.35), (rows[149], 0.41)):
        row["validation"] = {"accuracy": 0.86, "nll": nll, "ece": 0.05}
    history.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = validation_trajectory(history)
    assert [(p["step"], p["nll"]) for p in got] == [(75, 0.35), (150, 0.41)] and got[0]["member"] == 0
    manifest = {"training": {"run": {"steps": 150}}}
    assert training_summary(manifest, got)["trajectory"] == got
    assert "trajectory" not in training_summary(manifest, [])  # records without passes keep their old shape


def test_a_grid_adopts_the_search_candidate_that_trained_its_cell(bench_config, tmp_path, monkeypatch, capsys):
    """The search seed's cell whose training config equals the chosen candidate's (but for output and name) is copied
    from it, not trained again; a cell of another seed, a config that names another beta, or a search that chose
    another candidate, is trained."""
    from ibedl.training.config import load_config
    from ibedl.training.experiments import benchmark

    _, config = bench_config
    config = {**config, "search": {"seed": 0, "candidates": {"ib_edl": [{"method_params.beta": 1e-6},
                                                                          {"method_params.beta": 5e-6}]}},
              "method_params": {**config["method_params"], "ib_edl": {"num_samples": 2, "beta": 5e-6}}}
    monkeypatch.setattr(benchmark, "SEARCH_ROOT", tmp_path / "search")
    monkeypatch.setattr(benchmark, "search_results", lambda name: tmp_path / f"{name}_search.json")
    choose = lambda index: (tmp_path / "tiny_search.json").write_text(  # noqa: E731
        json.dumps({"chosen": {"ib_edl": {"index": index}}}))
    run = Run("id", "id", "sciq", "ib_edl", 0, ("sciq",))
    for index, beta in enumerate((1e-6, 5e-6)):
        candidate = tmp_path / "search" / "tiny" / f"ib_edl-{index}"
        candidate.mkdir(parents=True)
        overrides = benchmark.train_overrides(config, run, "ib_edl", candidate)
        trained = load_config(None, [*overrides, f"method_params.beta={beta}", f"name=ib_edl-{index}"]).to_dict()
        (candidate / "manifest.json").write_text(json.dumps({"training": {"config": trained}}))
        (candidate / "weights.safetensors").write_bytes(b"w%d" % index)
    root = tmp_path / "runs"
    assert benchmark.search_twin(config, run, "ib_edl", root) is None  # no search results yet
    choose(0)
    assert benchmark.search_twin(config, run, "ib_edl", root) is None  # the config names 5e-6, the search chose 1e-6
    choose(1)
    assert benchmark.search_twin(config, run, "ib_edl", root / "x") == tmp_path / "search" / "tiny" / "ib_edl-1"
    assert benchmark.search_twin(config, Run("id", "id", "sciq", "ib_edl", 1, ("sciq",)), "ib_edl", root) is None
    elsewhere = {**config, "method_params": {**config["method_params"], "ib_edl": {"num_samples": 2, "beta": 1e-5}}}
    assert benchmark.search_twin(elsewhere, run, "ib_edl", root) is None

    benchmark.Runner(config, root, tmp_path / "results.json", dry_run=True).ensure_trained(run, "ib_edl")
    assert capsys.readouterr().out.startswith(f"adopt {root / 'sciq-ib_edl-s0'} from ")
    runner = benchmark.Runner(config, root, tmp_path / "results.json")
    out, info = runner.ensure_trained(run, "ib_edl")
    assert (out / "weights.safetensors").read_bytes() == b"w1"
    assert info["adopted_from"].endswith("ib_edl-1")
    assert json.loads((out / "benchmark-train.json").read_text()) == info


def test_the_paper_ib_edl_arm_trains_as_the_one_rate_grid_but_for_what_its_header_names(monkeypatch):
    """benchmarks/sciq_grid_shared_lr_paper_ibedl.yaml copies the one-rate grid's train block: a later change to the
    grid must reach the arm, or its predictions no longer pair with the grid's as the same regime."""
    from pathlib import Path

    from ibedl.training.experiments.benchmark import load_benchmark_config

    monkeypatch.chdir(Path(__file__).resolve().parents[3])
    grid = load_benchmark_config("benchmarks/sciq_grid_shared_lr.yaml")
    arm = load_benchmark_config("benchmarks/sciq_grid_shared_lr_paper_ibedl.yaml")
    assert arm["train"]["lora"] == {**grid["train"]["lora"], "dropout": 0.1}
    assert {**arm["train"], "lora": None} == {**grid["train"], "lora": None}
    for key in ("sizes", "experiments", "method_train"):
        assert arm[key] == grid[key]
    assert arm["methods"] == ["ib_edl"] and set(arm["seeds"]) >= set(grid["seeds"])
    params = arm["method_params"]["ib_edl"]
    assert (params["risk"], params["inference"], params["inference_samples"], params["num_samples"]) == (
        "mse", "sampled", 20, 20)
    assert sorted(c["method_params.beta"] for c in arm["search"]["candidates"]["ib_edl"]) == [1e-6, 5e-6, 1e-5]


@pytest.mark.parametrize(("run", "machine"), [
    ({"machine": "cpu A"}, "cpu A"),
    ({"members": [{"machine": "cpu A"}, {"machine": "cpu A"}]}, "cpu A"),
    ({"members": [{"machine": "cpu A"}, {"machine": "gpu B"}]}, "cpu A + gpu B"),  # a member resumed elsewhere
    ({"members": [{"machine": "cpu A"}, {}]}, None),  # a member trained before machines were recorded
    ({"samples_per_s": 3.0}, None),
    ({"members": [], "machine": "cpu A"}, "cpu A"),
])
def test_the_machine_a_run_trained_on(run, machine):
    assert run_machine(run) == machine
