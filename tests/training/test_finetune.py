import json
import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch

from ibedl.core.artifact import read_manifest
from ibedl.core.predictor import Predictor
from ibedl.training import finetune
from ibedl.training.confidence_ceiling import confidence_ceiling
from ibedl.training.config import load_config
from ibedl.training.data import load_dataset
from ibedl.training.evaluate import evaluate
from ibedl.training.finetune import load_parts, main, run_questions, start_overlap, train

WORDS = ["sun", "moon", "water", "plant", "stone", "tree", "bird", "fish", "cloud", "river"]


@pytest.fixture(scope="module")
def jsonl_data(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "toy.jsonl"
    with path.open("w") as f:
        for i in range(40):
            n = rng.choice([3, 4, 5])
            opts = rng.sample(WORDS, n)
            f.write(
                json.dumps({"question": f"Which is {opts[0]}?", "options": opts, "answer": 0, "id": f"q{i}"}) + "\n"
            )
    return path


def overrides(tmp_path, model_dir, data, method, **extra) -> list[str]:
    """The toy run's ``key=value`` overrides (as ``python -m ibedl.training.finetune`` takes them)."""
    return [
        f"method={method}",
        f"base_model={model_dir}",
        f"output={tmp_path / method}",
        f"data={{train: [{{dataset: jsonl, path: {data}}}], validation: [{{dataset: jsonl, path: {data}, limit: 12}}],"
        f" test: [{{dataset: jsonl, path: {data}, limit: 10}}]}}",
        "optim.max_steps=3",
        "optim.batch_size=4",
        "optim.lr=1e-3",
        "max_tokens=128",
        "progress=false",
        "lora.targets=[q_proj, v_proj]",
    ] + [f"{k}={v}" for k, v in extra.items()]


def config(tmp_path, model_dir, data, method, **extra):
    return load_config(None, overrides(tmp_path, model_dir, data, method, **extra))


EXTRA = {"ib_edl": {"method_params.num_samples": 4}, "ensemble": {"method_params.members": 2},
         "mc_dropout": {"method_params.mc_samples": 3, "lora.dropout": 0.3}}


@pytest.mark.parametrize("method", ["map", "edl", "ib_edl", "vid", "i_edl", "r_edl", "mc_dropout", "ensemble"])
def test_train_save_reload_identical(tmp_path, tiny_model_dir, jsonl_data, method):
    cfg = config(tmp_path, tiny_model_dir, jsonl_data, method, **EXTRA.get(method, {}))
    out = train(cfg, command="pytest")
    members = ["members/0", "members/1"] if method == "ensemble" else ["."]
    assert (out / "manifest.json").is_file() and (out / "history.jsonl").is_file()
    for member in members:
        for name in ("head.safetensors", "adapter_config.json", "adapter_model.safetensors"):
            assert (out / member / name).is_file(), (member, name)
    manifest = read_manifest(out)
    assert manifest.method == method
    assert {"validation", "test"} <= set(manifest.metrics)
    assert manifest.calibration["split"] == "validation"  # training calibrates on its validation split
    assert manifest.calibration["n_fit"] + manifest.calibration["n_calibration"] == 12
    assert manifest.abstention["how"]["n"] == manifest.calibration["n_calibration"]
    assert len(manifest.reference["confidence"]) == 12
    assert (manifest.reference["uncertainty"] is None) == (method in ("map", "mc_dropout", "ensemble"))
    assert manifest.members == members
    assert manifest.mc_samples == (3 if method == "mc_dropout" else 0)
    ceiling = manifest.training["confidence_ceiling"]
    if method == "ib_edl":  # the beta and option count of this run, as ibedl.training.confidence_ceiling computes it
        expected = confidence_ceiling(manifest.method_config["beta"], ceiling["num_options"], "mse")
        assert ceiling["confidence"] == pytest.approx(expected.confidence)
        counts = Counter(len(q.options) for q in load_dataset("jsonl", "train", path=jsonl_data))
        assert ceiling["num_options"] == counts.most_common(1)[0][0]
    else:
        assert ceiling is None
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3] * len(members)
    runs = manifest.training["run"].get("members", [manifest.training["run"]])  # validation at the start and the end
    keys = {"accuracy", "mean_confidence", "ece", "nll", "brier"}
    assert all(set(r["validation_start"]) == keys and set(r["validation_end"]) == keys for r in runs)
    assert runs[-1]["validation_end"] != runs[-1]["validation_start"]  # three steps at lr 1e-3 moved the model
    assert all(r["stopped_by"] == "budget" and r["stopped_step"] == r["best_step"] == 3 for r in runs)
    # The reloaded adapter reproduces the validation metrics recorded at training time.
    reloaded = Predictor.from_artifact(out)
    val = evaluate(reloaded, load_dataset("jsonl", "validation", path=jsonl_data, limit=12), progress=False)
    for key in ("accuracy", "nll", "ece", "brier"):
        assert val.metrics[key] == pytest.approx(manifest.metrics["validation"][key], abs=1e-5), key
    # Head tensors are safetensors with the expected names.
    names = set(safetensors.torch.load_file(out / members[0] / "head.safetensors"))
    expected = {"softmax": {"weight"}, "evidential": {"weight", "bias"},
                "ib_edl": {"mu_weight", "mu_bias", "sigma_weight", "sigma_bias"}}[manifest.head["kind"]]
    assert names == expected


def test_centred_scaled_ib_edl_with_annealed_beta_is_recorded_and_served_as_trained(
    tmp_path, tiny_model_dir, jsonl_data
):
    cfg = config(tmp_path, tiny_model_dir, jsonl_data, "ib_edl", centre_options="true", evidence_scale=4,
                 **{"method_params.num_samples": 4, "method_params.beta": 1e-5, "method_params.beta_start": 1e-3,
                    "method_params.beta_anneal": 1.0})
    out = train(cfg, command="pytest")
    manifest = read_manifest(out)
    assert manifest.head["centre_options"] is True
    assert manifest.head["evidence_scale"] == 4
    assert manifest.method_config["beta_start"] == 1e-3
    assert manifest.training["confidence_ceiling"]["beta"] == 1e-5  # the ceiling of the final beta
    betas = [json.loads(x)["beta"] for x in (out / "history.jsonl").read_text().splitlines()]
    assert betas == pytest.approx([1e-3, 1e-3 * 1e-2 ** (1 / 3), 1e-3 * 1e-2 ** (2 / 3)], rel=1e-5)
    reloaded = Predictor.from_artifact(out)
    assert reloaded.head.config.centre_options is True
    assert reloaded.head.config.evidence_scale == 4
    val = evaluate(reloaded, load_dataset("jsonl", "validation", path=jsonl_data, limit=12), progress=False)
    assert val.metrics["nll"] == pytest.approx(manifest.metrics["validation"]["nll"], abs=1e-5)


def test_training_is_seeded(tmp_path, tiny_model_dir, jsonl_data):
    a = train(config(tmp_path / "a", tiny_model_dir, jsonl_data, "ib_edl", **{"method_params.num_samples": 4}))
    b = train(config(tmp_path / "b", tiny_model_dir, jsonl_data, "ib_edl", **{"method_params.num_samples": 4}))
    la = [json.loads(x)["loss"] for x in (a / "history.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (b / "history.jsonl").read_text().splitlines()]
    assert la == lb


def test_an_interrupted_ensemble_keeps_its_saved_members_and_ends_as_if_uninterrupted(tmp_path, tiny_model_dir,
                                                                                        jsonl_data, monkeypatch):
    extra = {"method_params.members": 3}
    whole = read_manifest(train(config(tmp_path / "whole", tiny_model_dir, jsonl_data, "ensemble", **extra)))
    cfg = config(tmp_path, tiny_model_dir, jsonl_data, "ensemble", **extra)
    out, stage = Path(cfg.output), finetune.staging_dir(Path(cfg.output))
    killed_at_member_2(cfg, monkeypatch)
    # Killed while member 2 trained: members 0 and 1 saved with their records, member 2 half-written, and nothing
    # at the output a loader would take for an artifact.
    assert not out.exists() and not (stage / "members" / "2" / "member.json").exists()
    kept = {m: (stage / "members" / m / "adapter_model.safetensors").stat().st_mtime_ns for m in ("0", "1")}
    manifest = read_manifest(train(cfg))
    assert not stage.exists()
    assert {m: (out / "members" / m / "adapter_model.safetensors").stat().st_mtime_ns for m in ("0", "1")} == kept
    runs = manifest.training["run"]["members"]
    for m in (0, 1):  # the record of the start that trained it
        record = json.loads((out / "members" / str(m) / "member.json").read_text())["run"]
        assert runs[m]["seconds"] == record["seconds"]
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [(h["member"], h["step"]) for h in history] == [(m, s) for m in (0, 1, 2) for s in (1, 2, 3)]
    # what the resumed run serves is what the uninterrupted one serves (CPU training is deterministic per seed)
    assert manifest.files == whole.files
    for key in ("accuracy", "nll", "ece"):
        assert manifest.metrics["validation"][key] == pytest.approx(whole.metrics["validation"][key], abs=1e-6)
    # another config after an interrupted start: no member is kept
    killed_at_member_2(cfg, monkeypatch)
    kept = {m: (stage / "members" / m / "adapter_model.safetensors").stat().st_mtime_ns for m in ("0", "1")}
    train(config(tmp_path, tiny_model_dir, jsonl_data, "ensemble", **extra, **{"optim.lr": 2e-3}))
    assert all((out / "members" / m / "adapter_model.safetensors").stat().st_mtime_ns != kept[m] for m in kept)


def killed_at_member_2(cfg, monkeypatch) -> None:
    """``train(cfg)`` killed while member 2 trains: it has written half its weights and a torn history line."""
    fit = finetune.fit_member

    def fit_or_die(*args, **kwargs):
        member_dir, history, member = args[5], args[7], args[8]
        if member == 2:
            member_dir.mkdir(parents=True, exist_ok=True)
            (member_dir / "adapter_model.safetensors").write_bytes(b"torn")
            with history.open("a") as f:
                f.write('{"member": 2, "step": 1}\n{"member": 2, "st')
            raise KeyboardInterrupt
        return fit(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(finetune, "fit_member", fit_or_die)
        with pytest.raises(KeyboardInterrupt):
            train(cfg)


def test_an_interrupted_run_leaves_the_artifact_it_would_replace_as_it_was(tmp_path, tiny_model_dir, jsonl_data,
                                                                         monkeypatch):
    """A run writes beside its output and replaces it only once complete: killed during its calibration, the
    artifact at the output is byte for byte the earlier one (a half-made one loaded and served uncalibrated)."""
    cfg = config(tmp_path, tiny_model_dir, jsonl_data, "map")
    out = train(cfg)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(finetune, "calibrate_and_evaluate", killed)
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path, tiny_model_dir, jsonl_data, "map", **{"optim.lr": 2e-3}))
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    monkeypatch.undo()
    again = train(config(tmp_path, tiny_model_dir, jsonl_data, "map", **{"optim.lr": 2e-3}))  # completes: replaced
    assert again == out and read_manifest(out).training["config"]["optim"]["lr"] == 2e-3
    assert sorted(p.name for p in out.parent.iterdir()) == ["map"]  # nothing staged or set aside is left


def test_a_publish_cut_short_anywhere_leaves_a_whole_artifact_that_the_next_start_puts_back(tmp_path, tiny_model_dir,
                                                                                              jsonl_data, monkeypatch):
    """publish() swaps directories by two renames: cut between them, the earlier artifact is whole at the set-aside
    name and the next start puts it back; cut after them, the caller's file comes back and nothing is set aside. (It
    replaced entry by entry: cut midway, the output held neither artifact.)"""
    out = train(config(tmp_path, tiny_model_dir, jsonl_data, "map"))
    (out / "train.log").write_text("the caller's")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    stage_rename = Path.rename

    def cut(at: str):
        def rename(self, target):
            if Path(target).resolve() == out.resolve() and at == "between" and self.name.endswith(".partial"):
                raise KeyboardInterrupt
            moved = stage_rename(self, target)
            if at == "after" and self.name.endswith(".partial"):
                raise KeyboardInterrupt
            return moved
        return rename

    for at in ("between", "after"):
        with monkeypatch.context() as patch:
            patch.setattr(Path, "rename", cut(at))
            with pytest.raises(KeyboardInterrupt):
                train(config(tmp_path, tiny_model_dir, jsonl_data, "map", **{"optim.lr": 2e-3}))
        if at == "between":
            assert not out.exists() and finetune.previous_dir(out).is_dir()
            finetune.settle(out)  # what the next start does first
            assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
        else:
            assert read_manifest(out).training["config"]["optim"]["lr"] == 2e-3  # the new one, whole
            again = train(config(tmp_path, tiny_model_dir, jsonl_data, "map", **{"optim.lr": 2e-3}))
            assert (again / "train.log").read_text() == "the caller's"
    assert sorted(p.name for p in out.parent.iterdir()) == ["map"]


def test_a_loss_that_is_not_finite_is_one_line_saying_what_to_change(tmp_path, tiny_model_dir, jsonl_data, capsys):
    """An evidence offset past float32 makes the first loss infinite: the loop's message, not its traceback."""
    assert main(overrides(tmp_path, tiny_model_dir, jsonl_data, "edl", evidence_bias="3e38")) == 2
    err = capsys.readouterr().err
    assert "error: loss is" in err and "at step 1;" in err and "lower optim.lr or check the data" in err
    assert "Traceback" not in err
    assert not (tmp_path / "edl").exists()


def test_an_output_holding_the_working_directory_is_refused_before_training(tmp_path, tiny_model_dir, jsonl_data,
                                                                            capsys, monkeypatch):
    """publish() renames the output aside: a process whose working directory is in it would be left in a removed
    directory (and main() read the manifest through a relative path that no longer resolved)."""
    (tmp_path / "map" / "logs").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "map" / "logs")
    assert main(overrides(tmp_path, tiny_model_dir, jsonl_data, "map")) == 2
    assert "holds the working directory, which a finished run replaces: run from elsewhere" in capsys.readouterr().err


def test_a_mount_point_output_is_refused_before_training(tmp_path, monkeypatch):
    import os

    monkeypatch.setattr(os.path, "ismount", lambda p: str(p) == str(tmp_path / "mnt"))
    (tmp_path / "mnt").mkdir()
    with pytest.raises(ValueError, match="is a mount point, which a finished run cannot replace by a rename"):
        finetune.check_output(tmp_path / "mnt")
    finetune.check_output(tmp_path / "elsewhere")  # not there yet: fine


def test_an_output_that_is_a_file_is_refused_before_training(tmp_path, tiny_model_dir, jsonl_data, capsys):
    (tmp_path / "map").write_text("notes")
    assert main(overrides(tmp_path, tiny_model_dir, jsonl_data, "map")) == 2
    assert "is a file, not an artifact directory" in capsys.readouterr().err
    assert (tmp_path / "map").read_text() == "notes" and not finetune.staging_dir(tmp_path / "map").exists()


def test_what_else_the_output_directory_holds_stays(tmp_path, tiny_model_dir, jsonl_data):
    """A caller's own file there (the benchmark's train.log) is left; the artifact's entries are replaced."""
    (tmp_path / "map").mkdir()
    (tmp_path / "map" / "train.log").write_text("the caller's")
    out = train(config(tmp_path, tiny_model_dir, jsonl_data, "map"))
    assert (out / "train.log").read_text() == "the caller's" and read_manifest(out).method == "map"


def test_a_device_this_machine_lacks_is_refused_before_training(tmp_path, tiny_model_dir, jsonl_data, capsys):
    assert main(overrides(tmp_path, tiny_model_dir, jsonl_data, "map", device="bogus")) == 2
    assert "device 'bogus' is not cpu, cuda or cuda:<index>" in capsys.readouterr().err
    assert not (tmp_path / "map").exists() and not finetune.staging_dir(tmp_path / "map").exists()


def test_an_ensemble_copies_its_first_member_from_maps_run_of_its_seed(tmp_path, tiny_model_dir, jsonl_data, caplog):
    extra = {"method_params.members": 2}
    whole = read_manifest(train(config(tmp_path / "whole", tiny_model_dir, jsonl_data, "ensemble", **extra)))
    donor = train(config(tmp_path, tiny_model_dir, jsonl_data, "map"))
    assert (donor / "member.json").is_file()  # a single adapter's run records its training too
    donor_weights = (donor / "adapter_model.safetensors").stat().st_mtime_ns
    with caplog.at_level("INFO", logger="ibedl.training.finetune"):
        out = train(config(tmp_path, tiny_model_dir, jsonl_data, "ensemble", **extra, members_from=f"[{donor}]"))
    assert any(f"member 0: copied from {donor}" in r.getMessage() for r in caplog.records)
    assert not any("member 1: copied" in r.getMessage() for r in caplog.records)
    manifest = read_manifest(out)
    # exactly what training it would have served: the same weights, metrics and per-step history
    assert manifest.files == whole.files
    for key in ("accuracy", "nll", "ece"):
        assert manifest.metrics["validation"][key] == pytest.approx(whole.metrics["validation"][key], abs=1e-6)
    steps = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]
    donor_steps = [json.loads(x) for x in (donor / "history.jsonl").read_text().splitlines()]
    assert [h for h in steps if h["member"] == 0] == donor_steps
    assert [(h["member"], h["step"]) for h in steps] == [(m, s) for m in (0, 1) for s in (1, 2, 3)]
    assert manifest.training["run"]["members"][0]["seconds"] == read_manifest(donor).training["run"]["seconds"]
    assert (donor / "adapter_model.safetensors").stat().st_mtime_ns == donor_weights  # the donor is left as it was
    # a MAP run trained otherwise (another learning rate) is no member: both are trained
    other = train(config(tmp_path / "other", tiny_model_dir, jsonl_data, "map", **{"optim.lr": 2e-3}))
    caplog.clear()
    with caplog.at_level("INFO", logger="ibedl.training.finetune"):
        train(config(tmp_path / "again", tiny_model_dir, jsonl_data, "ensemble", **extra, members_from=f"[{other}]"))
    assert not any("copied from" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("method", "members_from", "message"), [
    ("map", "[{tmp}]", "members_from is for a run of several members"),
    ("ensemble", "[{tmp}/absent]", "members_from: no such directory"),
])
def test_members_from_is_refused_where_it_cannot_apply(tmp_path, tiny_model_dir, jsonl_data, method, members_from,
                                                       message):
    cfg = config(tmp_path, tiny_model_dir, jsonl_data, method, members_from=members_from.format(tmp=tmp_path))
    with pytest.raises(ValueError, match=message):
        train(cfg)


def test_one_process_trains_as_before_the_accelerate_loop(tmp_path, tiny_model_dir, jsonl_data):
    # Recorded at 7e9f104, the hand-written loop before training ran through accelerate (ibedl.training.distributed):
    # IB-EDL samples, LoRA dropout and a validation pass at step 2. One process must reproduce them. Re-recorded
    # once since, when IB-EDL's sigma rows started from the option rows instead of 0.01 x them with bias -4 (the
    # loop unchanged: the validation NLL, which mean inference reads from mu alone, moved by 6e-5).
    cfg = config(
        tmp_path,
        tiny_model_dir,
        jsonl_data,
        "ib_edl",
        **{"method_params.num_samples": 4, "optim.max_steps": 4, "eval_every": 2, "eval_limit": 6},
    )
    steps = [json.loads(x) for x in (train(cfg) / "history.jsonl").read_text().splitlines()]
    # float32 numbers recorded on another machine: another CPU's kernels (ATen's SIMD width, MKL's and oneDNN's code
    # paths) move them by ~1e-7 relative (measured with all three capped to AVX2: bit for bit the same; to SSE4.2: up
    # to 1.0e-7); a change to the training moves them by more (the sigma rows' one above: 4e-5). rel 1e-5 tells them
    # apart.
    assert [h["loss"] for h in steps] == pytest.approx([0.8608139753341675, 0.8135029077529907, 0.8216605186462402,
                                                        0.8812224268913269], rel=1e-5)
    assert [h["grad_norm"] for h in steps] == pytest.approx([0.7055407762527466, 0.8597203493118286, 0.7531123757362366,
                                                             0.5911774635314941], rel=1e-5)
    assert steps[1]["validation"]["nll"] == pytest.approx(1.3807639930859954, rel=1e-5)


def test_subset_seed_picks_the_training_subset_independently_of_the_run_seed(tmp_path, jsonl_data):
    def subset(*overrides):
        cfg = load_config(
            None,
            [
                "method=map",
                f"output={tmp_path}",
                f"data={{train: [{{dataset: jsonl, path: {jsonl_data}, limit: 10}}],"
                f" validation: [{{dataset: jsonl, path: {jsonl_data}, limit: 5}}]}}",
                *overrides,
            ],
        )
        return [q.id for q in load_parts(cfg.data.train, "train", cfg)]

    first, other = subset("seed=0"), subset("seed=1")
    assert len(first) == 10 and set(first) != set(other)  # the run's seed picks the subset by default
    assert subset("seed=1", "data.subset_seed=0") == first  # a second stage can see the first stage's questions


def test_disjoint_from_draws_training_questions_its_start_did_not_draw(tmp_path, jsonl_data):
    def run_config(*extra):
        return load_config(None, ["method=map", f"output={tmp_path / 'run'}",
                                  f"data={{train: [{{dataset: jsonl, path: {jsonl_data}, limit: 15}}],"
                                  f" validation: [{{dataset: jsonl, path: {jsonl_data}, limit: 5}}]}}", *extra])

    # a start whose manifest says it trained on 20 of the 40 questions (drawn with seed 0)
    start = tmp_path / "start"
    start.mkdir()
    start_cfg = load_config(None, ["method=map", f"output={start}",
                                   f"data={{train: [{{dataset: jsonl, path: {jsonl_data}, limit: 20}}],"
                                   f" validation: [{{dataset: jsonl, path: {jsonl_data}, limit: 5}}]}}"])
    (start / "manifest.json").write_text(json.dumps({"training": {"config": start_cfg.to_dict()}}))
    seen = {q.id for q in load_parts(start_cfg.data.train, "train", start_cfg)}

    cfg = run_config(f"init_from={start}", f"data.disjoint_from={start}")
    drawn = load_parts(cfg.data.train, "train", cfg)
    assert len(drawn) == 15 and not {q.id for q in drawn} & seen
    assert start_overlap(cfg, drawn) == {"start": str(start), "questions": 15, "seen_by_start": 0,
                                         "disjoint_from": str(start)}
    # without it the same seed draws 15 of the start's 20 (a smaller limit picks a subset of a larger one's)
    same = run_config(f"init_from={start}")
    assert start_overlap(same, load_parts(same.data.train, "train", same))["seen_by_start"] == 15
    assert start_overlap(run_config(), drawn) is None  # no start, nothing to overlap


def test_disjoint_from_must_name_an_artifact_with_a_training_config(tmp_path):
    base = ["method=map", f"output={tmp_path / 'run'}",
            "data={train: [{dataset: sciq}], validation: [{dataset: sciq}]}"]
    with pytest.raises(ValueError, match="data.disjoint_from must be an artifact directory with a manifest.json, got"):
        load_config(None, [*base, f"data.disjoint_from={tmp_path / 'nowhere'}"])
    (tmp_path / "manifest.json").write_text(json.dumps({"training": {}}))
    with pytest.raises(ValueError, match="its manifest has no training.config"):
        load_config(None, [*base, f"data.disjoint_from={tmp_path}"])


def test_run_questions_rebuild_a_noisy_runs_training_and_validation_questions(tmp_path, tiny_model_dir, jsonl_data):
    # what evaluate_run makes a predictive fit on: the training draw and noisy labels the run trained with
    cfg = config(tmp_path, tiny_model_dir, jsonl_data, "map", seed=1, **{"data.label_noise": 0.5, "data.noise_seed": 3})
    rebuilt_cfg, train_q, val_q = run_questions({"config": cfg.to_dict()})
    assert rebuilt_cfg.seed == 1 and rebuilt_cfg.data.label_noise == 0.5
    assert train_q == load_parts(cfg.data.train, "train", cfg) and val_q == load_parts(
        cfg.data.validation, "validation"
    )
    assert len(val_q) == 12 and sum(q.answer != 0 for q in train_q) > 0  # every toy answer is A: moved labels differ
    assert all(q.answer == 0 for q in val_q)  # validation keeps clean labels


def test_cli_reports_bad_config(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "method: map\noutput: x\ndata: {train: [{dataset: sciq}], validation: [{dataset: sciq}]}\nbogus: 1\n"
    )
    assert main(["--config", str(bad)]) == 2
    assert "unknown config keys ['bogus']" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2


def test_method_params_are_checked_when_the_config_loads(tmp_path, tiny_model_dir, jsonl_data):
    with pytest.raises(ValueError, match=r"method 'edl' has no hyper-parameters \['beta'\]"):
        config(tmp_path, tiny_model_dir, jsonl_data, "edl", **{"method_params.beta": 1})
    with pytest.raises(ValueError, match=r"method_params.beta must be a finite number >= 0, got -1"):
        config(tmp_path, tiny_model_dir, jsonl_data, "ib_edl", **{"method_params.beta": -1})
    with pytest.raises(ValueError, match=r"unknown method 'bogus'"):
        config(tmp_path, tiny_model_dir, jsonl_data, "bogus")


def test_early_stopping_keeps_the_state_of_the_lowest_validation_nll():
    from ibedl.training.finetune import EarlyStopping

    module = torch.nn.Linear(2, 1)
    stopper = EarlyStopping(2, module)
    states = []
    for step, nll in enumerate([1.0, 0.8, 0.9, 0.95]):
        with torch.no_grad():
            module.weight.fill_(float(step))
        states.append(module.weight.detach().clone())
        assert not stopper.should_stop
        stopper.observe(step, {"nll": nll})
    assert stopper.should_stop and stopper.best_step == 1 and stopper.best_metrics == {"nll": 0.8}
    stopper.restore()
    torch.testing.assert_close(module.weight, states[1])
    inactive = EarlyStopping(None, module)
    inactive.observe(0, {"nll": 0.1})
    assert not inactive.should_stop and inactive.best_state is None


def test_questions_shared_between_splits_are_warned_of(caplog):
    from ibedl.core.prompt import MCQuestion

    q = [MCQuestion(f"q{i}", ("a", "b"), None, 0, f"id{i}") for i in range(4)]
    again = MCQuestion("q0", ("a", "b"), None, 1, "other-id")  # the same question under another id and label
    with caplog.at_level("WARNING", logger="ibedl.training.finetune"):
        shared = finetune.warn_overlap({"train": q[:2], "validation": [again, q[2]], "test": [q[3]]})
    assert shared == {("train", "validation"): 1}
    assert "1 of the 2 validation questions are also train questions" in caplog.text
    assert finetune.warn_overlap({"train": q[:2], "validation": q[2:], "test": []}) == {}


@pytest.mark.parametrize(("eval_every", "patience", "total", "due"), [
    (100, 5, 250, [100, 200, 250]),  # early stopping: the last steps are validated too, or never kept
    (100, None, 250, [100, 200]),  # without it the end's own validation scores the last state
    (100, None, 200, [100]),
    (0, 2, 25, [10, 20, 25]),  # each epoch's end (10 steps), and the budget's
    (0, None, 25, []),
])
def test_validation_passes(eval_every, patience, total, due):
    cfg = SimpleNamespace(eval_every=eval_every, optim=SimpleNamespace(patience=patience))
    assert [s for s in range(1, total + 1) if finetune.validation_due(cfg, s, total, 10)] == due


def test_history_records_the_learning_rate_each_step_used(tmp_path, tiny_model_dir, jsonl_data):
    """3 steps: one of warm-up (lr), then the cosine from lr at step 2 (frac 0) to lr/2 at step 3 (frac 1/2); each
    row said the next step's rate (1e-3, 5e-4, 0)."""
    out = train(config(tmp_path, tiny_model_dir, jsonl_data, "map"))
    rates = [json.loads(line)["lr"] for line in (out / "history.jsonl").read_text().splitlines()]
    assert rates == pytest.approx([1e-3, 1e-3, 5e-4])


def test_patience_validates_each_epoch_and_saves_the_best_state(tmp_path, tiny_model_dir, jsonl_data):
    # 40 questions, batch 4: 10 steps an epoch; a budget of 6 epochs at a high learning rate.
    cfg = config(tmp_path, tiny_model_dir, jsonl_data, "map", **{"optim.max_steps": "null", "optim.epochs": 6,
                                                                 "optim.patience": 2, "optim.lr": 3e-2})
    out = train(cfg)
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    passes = [h for h in history if "validation" in h]
    assert [h["step"] for h in passes] == list(range(10, history[-1]["step"] + 1, 10))  # at every epoch's end
    run = read_manifest(out).training["run"]
    nlls = [run["validation_start"]["nll"]] + [h["validation"]["nll"] for h in passes]
    assert run["validation_end"]["nll"] == min(nlls)
    assert run["best_step"] == ([0] + [h["step"] for h in passes])[nlls.index(min(nlls))]
    assert run["stopped_step"] == history[-1]["step"] and run["budget_steps"] == 60
    if run["stopped_by"] == "patience":
        assert run["stopped_step"] - run["best_step"] == 20 and run["stopped_step"] < 60
    else:
        assert run["stopped_step"] == 60
    # What was saved is the best state: the reloaded adapter has its validation NLL (MAP: no post-hoc step).
    reloaded = Predictor.from_artifact(out)
    val = evaluate(reloaded, load_dataset("jsonl", "validation", path=jsonl_data, limit=12), progress=False)
    assert val.metrics["nll"] == pytest.approx(run["validation_end"]["nll"], abs=1e-5)


def test_training_resolves_the_base_model_and_loads_its_tokenizer_once(tmp_path, tiny_model_dir, jsonl_data,
                                                                        monkeypatch):
    """resolve_model identifies a model directory by hashing its weights (_directory_sha; a GGUF: sha256_file of the
    file): one training run (train, calibrate, evaluate) resolves it once and loads one tokenizer."""
    import transformers

    from ibedl.core import base_model

    calls = Counter()
    directory_sha, from_pretrained = base_model._directory_sha, transformers.AutoTokenizer.from_pretrained

    def counting_sha(path):
        calls["hash"] += 1
        return directory_sha(path)

    def counting_tokenizer(*args, **kwargs):
        calls["tokenizer"] += 1
        return from_pretrained(*args, **kwargs)

    monkeypatch.setattr(base_model, "_directory_sha", counting_sha)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counting_tokenizer)
    train(config(tmp_path, tiny_model_dir, jsonl_data, "map", **{"optim.max_steps": 1}), command="pytest")
    assert calls == {"hash": 1, "tokenizer": 1}


def test_the_default_batches_of_a_seed_are_those_drawn_before_the_gpu_work():
    # Recorded before issue 58's throughput work (2fa4d48): committed grids depend on which questions each step sees,
    # so the default draw (length_grouped_batches, then micro_batches) must not move. A GPU setting that changes it
    # has to be opt-in.
    import hashlib

    from ibedl.core.prompt import MCQuestion
    from ibedl.training.finetune import length_grouped_batches, micro_batches

    rng = random.Random(7)
    questions = [MCQuestion(f"q{i} " + "word " * rng.randint(1, 40),
                            tuple(f"opt{j}" * rng.randint(1, 5) for j in range(rng.choice([3, 4, 5]))),
                            context=("ctx " * rng.randint(0, 60)) or None) for i in range(300)]
    draw = random.Random(1)
    epochs = [length_grouped_batches(questions, 8, draw) for _ in range(2)]
    assert epochs[0][:3] == [[166, 34, 21, 2, 139, 218, 251, 263], [0, 172, 24, 156, 84, 180, 278, 62],
                             [66, 264, 9, 260, 279, 121, 225, 202]]
    assert hashlib.sha256(json.dumps(epochs).encode()).hexdigest() == (
        "253cb66fff8b41b6db8d77c0011c6e32715a44c9ca26043c4a213082d6a10f7c")
    assert micro_batches(list(range(10)), 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert micro_batches([1, 2], 3) == [[1], [2], [2]]


def test_torch_compile_is_opt_in_and_compiles_the_trunk_that_trains(tmp_path, tiny_model_dir, jsonl_data,
                                                                    monkeypatch):
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda module, **options: compiled.append((module, options)) or module)
    train(config(tmp_path / "off", tiny_model_dir, jsonl_data, "map", **{"optim.max_steps": 1}))
    assert compiled == []
    train(config(tmp_path / "on", tiny_model_dir, jsonl_data, "map", **{"optim.max_steps": 1, "torch_compile": True}))
    ((module, options),) = compiled
    assert type(module).__name__ == "LlamaModel" and options == {"dynamic": True}


@pytest.mark.parametrize("key", ["torch_compile", "gradient_checkpointing"])
def test_a_setting_that_changes_no_gradient_leaves_a_members_fingerprint_as_before(key):
    from ibedl.training import member_resume

    before = {"method": "map", "seed": 0, "threads": None}  # a config written before the key existed
    assert member_resume.fingerprint({**before, key: True}, 0, "sha") == member_resume.fingerprint(before, 0, "sha")


def ib_edl_step(cfg) -> tuple[int, list[torch.Tensor]]:
    """(bytes autograd kept, gradients) of one IB-EDL forward and backward pass of the model ``cfg`` builds, from
    LoRA weights, dropout masks and loss samples drawn with fixed seeds (the benchmark's own passes)."""
    from benchmarks.gradient_checkpointing import kept_bytes, one_pass
    from ibedl.core.prompt import MCQuestion
    from ibedl.training.distributed import OptionScorer
    from ibedl.training.finetune import build
    from ibedl.training.methods import METHODS

    method = METHODS["ib_edl"]
    torch.manual_seed(0)  # the same LoRA initialisation
    predictor, _, _, params, _ = build(cfg, method)
    layers = predictor.decoder.layers
    assert len(layers) > 1 and {layer.gradient_checkpointing for layer in layers} == {cfg.gradient_checkpointing}
    assert not predictor.decoder.embed_tokens._forward_hooks  # no input hook left behind (reentrant form's)
    scorer = OptionScorer(predictor).train()
    questions = [MCQuestion(f"Which is number {i}?", ("one", "two", "three"), answer=i % 3) for i in range(4)]
    enc, y = predictor.encode(questions), torch.tensor([q.answer for q in questions])
    return kept_bytes(scorer, method, params, enc, y, seed=1), one_pass(scorer, method, params, enc, y, seed=1)[1]


def test_gradient_checkpointing_keeps_fewer_activations_for_the_same_gradients(tmp_path, tiny_model_dir, jsonl_data):
    kept, grads = {}, {}
    for on in (False, True):
        kept[on], grads[on] = ib_edl_step(config(tmp_path, tiny_model_dir, jsonl_data, "ib_edl",
                                                 **{"gradient_checkpointing": on, "lora.dropout": 0.3}))
    assert kept[True] < 0.5 * kept[False]
    for with_, without in zip(grads[True], grads[False], strict=True):
        torch.testing.assert_close(with_, without, rtol=1e-5, atol=1e-7)


def test_a_run_with_gradient_checkpointing_trains_the_same_adapter(tmp_path, tiny_model_dir, jsonl_data):
    """Whole runs (LoRA dropout 0.3, 3 steps, evaluation and calibration in eval mode): the adapter and head trained
    with checkpointing equal those trained without, so a member's fingerprint may leave the key out."""
    outs = [train(config(tmp_path / str(on), tiny_model_dir, jsonl_data, "ib_edl", **{
        "optim.max_steps": 3, "lora.dropout": 0.3, "gradient_checkpointing": on, **EXTRA["ib_edl"]})) for on in (0, 1)]
    assert json.loads((outs[1] / "manifest.json").read_text())["training"]["config"]["gradient_checkpointing"] is True
    for name in ("adapter_model.safetensors", "head.safetensors"):
        without, with_ = (safetensors.torch.load_file(out / name) for out in outs)
        assert with_.keys() == without.keys()
        for key in without:
            torch.testing.assert_close(with_[key], without[key], rtol=1e-5, atol=1e-7)


def test_gradient_checkpointing_takes_either_name_transformers_gives_it_and_refuses_a_model_without():
    from ibedl.training.finetune import enable_gradient_checkpointing

    class Older:  # transformers before 5.2x: gradient_checkpointing_* only
        supports_gradient_checkpointing = True
        calls = []

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs):
            self.calls.append(("enable", gradient_checkpointing_kwargs))

        def gradient_checkpointing_disable(self):
            self.calls.append(("disable",))

    old = Older()
    enable_gradient_checkpointing(old)
    enable_gradient_checkpointing(old, on=False)
    assert old.calls == [("enable", {"use_reentrant": False}), ("disable",)]

    class Without:
        supports_gradient_checkpointing = False

    with pytest.raises(ValueError, match="Without does not support gradient checkpointing"):
        enable_gradient_checkpointing(Without())
