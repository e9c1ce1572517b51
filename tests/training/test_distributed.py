"""Training through accelerate: two CPU processes (DDP over gloo) against one, gradient accumulation, tracking to
TensorBoard files, and the settings that cannot run on a CPU (FSDP, mixed precision)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import yaml

from benchmarks.service_process import free_port
from ibedl.core.artifact import read_manifest
from ibedl.training import distributed
from ibedl.training.config import load_config
from ibedl.training.distributed import fsdp_plugin, make_accelerator
from ibedl.training.finetune import micro_batches, train
from tests.training.test_finetune import config, jsonl_data, overrides  # noqa: F401 - the toy data fixture

REPO = Path(__file__).resolve().parents[2]
# MAP without LoRA dropout is deterministic: runs that see the same questions at every step differ only by float
# rounding. Periodic validation at step 2 goes through gather_for_metrics under two processes.
RUN = {"optim.max_steps": 4, "lora.dropout": 0, "eval_every": 2, "eval_limit": 6, "device": "cpu"}
# Measured: losses and gradient norms equal to the last digit, weights within 1e-8. What may differ is float
# rounding only: each process pads its share to its own longest prompt (other matmul shapes) and the gradient
# all-reduce sums in another order; over 4 steps that stays far below 1e-5 relative.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir, jsonl_data):  # noqa: F811
    """The reference: one process, batch 4."""
    return train(config(tmp_path_factory.mktemp("one"), tiny_model_dir, jsonl_data, "map", **RUN,
                        **{"optim.batch_size": 4}))


def history(artifact: Path) -> list[dict]:
    return [json.loads(line) for line in (artifact / "history.jsonl").read_text().splitlines()]


def assert_same_run(artifact: Path, reference: Path) -> None:
    """Same losses, gradient norms and validation at every step, same weights and final metrics, within TOLERANCE."""
    got, want = history(artifact), history(reference)
    assert [h["step"] for h in got] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "batch_accuracy", "lr"):
        assert [h[key] for h in got] == pytest.approx([h[key] for h in want], rel=TOLERANCE), key
    assert got[1]["validation"] == pytest.approx(want[1]["validation"], rel=TOLERANCE)
    for name in ("adapter_model.safetensors", "head.safetensors"):
        a, b = safetensors.torch.load_file(artifact / name), safetensors.torch.load_file(reference / name)
        assert a.keys() == b.keys()
        for key in a:
            assert (a[key] - b[key]).abs().max().item() < TOLERANCE, (name, key)
    metrics, expected = read_manifest(artifact).metrics, read_manifest(reference).metrics
    for split in ("validation", "test"):
        for key in ("accuracy", "nll", "ece", "brier"):
            assert metrics[split][key] == pytest.approx(expected[split][key], rel=TOLERANCE), (split, key)


def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path, tiny_model_dir, jsonl_data, one_process):  # noqa: F811
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(free_port())]  # not 29500: another run on this machine may hold it
    args = overrides(tmp_path, tiny_model_dir, jsonl_data, "map", **RUN,
                     **{"optim.batch_size": 2, "track_dir": tmp_path / "runs"})
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf")}  # no accelerate config file of this machine's user
    done = subprocess.run([*launch, "-m", "ibedl.training.finetune", "--track", "tensorboard", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    artifact = tmp_path / "map"
    # The main process alone prints progress lines and the result.
    assert done.stdout.count("step 2: validation") == 1
    assert json.loads(done.stdout[done.stdout.index("{\n"):])["artifact"] == str(artifact)
    assert sorted(p.name for p in artifact.iterdir()) == sorted(p.name for p in one_process.iterdir())
    manifest = read_manifest(artifact)
    assert (manifest.training["run"]["processes"], manifest.training["run"]["global_batch_size"]) == (2, 4)
    assert len(list((tmp_path / "runs" / "map").glob("events.out.tfevents.*"))) == 1  # one tracker writer
    assert_same_run(artifact, one_process)


def test_ib_edl_with_a_constant_sigma_trains_under_two_processes(tmp_path, tiny_model_dir, jsonl_data):  # noqa: F811
    """The sigma_constant ablation's loss never reads the sigma head: left trainable, DDP's reducer failed at the
    second step ("parameters that were not used in producing loss")."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(free_port())]
    args = overrides(tmp_path, tiny_model_dir, jsonl_data, "ib_edl", **{
        "optim.max_steps": 2, "optim.batch_size": 2, "device": "cpu", "method_params.sigma_constant": 0.5,
        "method_params.num_samples": 2})
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run([*launch, "-m", "ibedl.training.finetune", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert [h["step"] for h in history(tmp_path / "ib_edl")] == [1, 2]


def test_gradient_accumulation_matches_the_larger_batch(tmp_path, tiny_model_dir, jsonl_data, one_process):  # noqa: F811
    artifact = train(config(tmp_path, tiny_model_dir, jsonl_data, "map", **RUN,
                            **{"optim.batch_size": 2, "optim.gradient_accumulation_steps": 2}))
    assert read_manifest(artifact).training["run"]["global_batch_size"] == 4
    assert_same_run(artifact, one_process)


def test_tensorboard_holds_the_losses_metrics_and_manifest_of_the_run(tmp_path, tiny_model_dir, jsonl_data):  # noqa: F811
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = tmp_path / "runs"
    artifact = train(config(tmp_path, tiny_model_dir, jsonl_data, "map", **RUN, track="tensorboard", track_dir=runs))
    events = EventAccumulator(str(runs / "map"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    steps = history(artifact)
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(h["step"], h["loss"]) for h in steps]
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([h["lr"] for h in steps], rel=1e-6)
    assert [(e.step, e.value) for e in events.Scalars("validation/nll")] == [
        (2, pytest.approx(steps[1]["validation"]["nll"], rel=1e-6))]
    manifest = json.loads((artifact / "manifest.json").read_text())
    for split in ("validation", "test"):
        assert events.Scalars(f"final/{split}/nll")[0].value == pytest.approx(manifest["metrics"][split]["nll"],
                                                                             rel=1e-6)
    text = events.Tensors("manifest/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text) == manifest
    (hparams,) = runs.glob("map/*/hparams.yml")
    logged = yaml.safe_load(hparams.read_text())
    assert (logged["optim.lr"], logged["method"], logged["track"]) == (1e-3, "map", "tensorboard")


def test_tracking_is_off_by_default(tmp_path):
    cfg = settings(tmp_path)
    assert cfg.track is None and make_accelerator(cfg).trackers == []


def test_micro_batches_split_a_step_into_near_equal_parts():
    assert micro_batches([1, 2, 3, 4, 5, 6, 7], 2) == [[1, 2, 3, 4], [5, 6, 7]]
    assert micro_batches([1, 2, 3, 4, 5], 1) == [[1, 2, 3, 4, 5]]
    assert micro_batches([8, 9], 3) == [[8], [9], [9]]  # an end-of-epoch step shorter than the parts


def settings(tmp_path, *extra):
    return load_config(None, ["method=map", f"output={tmp_path}", "device=cpu",
                              "data={train: [{dataset: sciq}], validation: [{dataset: sciq}]}", *extra])


@pytest.mark.parametrize("extra, message", [
    (["mixed_precision=fp8"], r"mixed_precision must be 'no', 'bf16' or 'fp16', got 'fp8'"),
    (["track=wandb"], r"track must be 'tensorboard' or 'mlflow', got 'wandb'"),
    (["optim.gradient_accumulation_steps=0"], "optim.gradient_accumulation_steps must be an integer >= 1, got 0"),
    (["fsdp=true", "load_in_4bit=true"], "fsdp cannot shard a 4-bit base"),
    (["fsdp=true", "eval_every=10"], "eval_every must be 0"),
])
def test_bad_settings_are_refused_with_the_setting_named(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        settings(tmp_path, *extra)


@pytest.mark.parametrize("key, value, message", [
    ("fsdp", True, "fsdp needs CUDA devices"),
    ("mixed_precision", "bf16", "mixed_precision=bf16 needs a CUDA device"),
])
def test_cuda_only_settings_parse_and_are_refused_on_a_cpu(tmp_path, key, value, message):
    cfg = settings(tmp_path, f"{key}={str(value).lower()}")
    assert getattr(cfg, key) == value
    with pytest.raises(ValueError, match=message):
        make_accelerator(cfg)


def test_fsdp_plugin_is_accepted_by_the_pinned_accelerate():
    plugin = fsdp_plugin()  # FSDP itself needs GPUs: this checks the settings accelerate receives, not sharding
    assert (plugin.fsdp_version, plugin.state_dict_type.name, plugin.reshard_after_forward) == (
        2, "FULL_STATE_DICT", True)


def test_a_missing_tracker_package_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(distributed.INSTALLED, "tensorboard", lambda: False)
    with pytest.raises(ValueError,
                       match=r"track=tensorboard needs the tensorboard package \(pip install -e '.\[track\]'\)"):
        make_accelerator(settings(tmp_path, "track=tensorboard"))


@pytest.mark.parametrize("variable, value, message", [
    ("ACCELERATE_MIXED_PRECISION", "bf16", r"mixed_precision=bf16 \(the config has no\)"),
    ("ACCELERATE_USE_FSDP", "true", r"fsdp=True \(the config has False\)"),
    ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4", r"optim.gradient_accumulation_steps=4 \(the config has 1\)"),
])
def test_a_launcher_flag_that_contradicts_the_config_is_refused(tmp_path, monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)  # what accelerate launch --mixed_precision / --use_fsdp / ... set
    with pytest.raises(ValueError, match="accelerate launch asks for " + message):
        make_accelerator(settings(tmp_path))
