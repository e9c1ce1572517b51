"""A few training steps on real data with the real model: save, reload, identical predictions; and the
evaluate CLI on a small real subset."""

import json

import pytest
import torch

from ibedl.core.predictor import Predictor
from ibedl.training.config import load_config
from ibedl.training.data import load_dataset
from ibedl.training.evaluate import main as evaluate_main
from ibedl.training.finetune import train


@pytest.fixture(scope="module")
def trained(tmp_path_factory, real_model_ref):
    out = tmp_path_factory.mktemp("real") / "ib_edl"
    cfg = load_config("ibedl/training/configs/smollm2_science_ib_edl.yaml", [
        f"output={out}", "optim.max_steps=3", "optim.batch_size=2",
        "data.train=[{dataset: sciq, limit: 6}]", "data.validation=[{dataset: sciq, limit: 8}]",
        "data.test=[{dataset: sciq, limit: 6}]", "eval_every=0", "progress=false", "method_params.num_samples=4",
        "max_tokens=256",
    ])
    return train(cfg, command="pytest"), cfg


def test_manifest_records_real_base_model(trained, real_model_ref):
    out, _ = trained
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["base_model"]["name"] == "smollm2-135m-instruct"
    assert manifest["base_model"]["sha256"] == real_model_ref.sha256
    assert manifest["option_token_ids"][:4] == [330, 389, 340, 422]  # " A".." D" in SmolLM2's vocabulary
    assert manifest["prompt"]["template"] == "chat-v1"
    # Portable: the adapter config names the base by its known name, not this machine's cache path.
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == manifest["base_model"]["ref"] == "smollm2-135m-instruct"
    assert config["task_type"] == "CAUSAL_LM"
    card = (out / "README.md").read_text()
    assert 'base_model: "HuggingFaceTB/SmolLM2-135M-Instruct"' in card and real_model_ref.sha256 in card


def test_reload_gives_identical_predictions(trained):
    out, cfg = trained
    questions = load_dataset("sciq", "test", limit=6)
    first = Predictor.from_artifact(out)
    second = Predictor.from_artifact(out)
    with torch.no_grad():
        a = first.forward(first.encode(questions))
        b = second.forward(second.encode(questions))
    torch.testing.assert_close(a.alpha, b.alpha, rtol=0, atol=0)
    torch.testing.assert_close(a.sigma, b.sigma, rtol=0, atol=0)
    # and equal to what training recorded on its validation split
    manifest = json.loads((out / "manifest.json").read_text())
    from ibedl.training.evaluate import evaluate

    val = evaluate(first, load_dataset("sciq", "validation", limit=8), progress=False)
    assert val.metrics["nll"] == pytest.approx(manifest["metrics"]["validation"]["nll"], abs=1e-5)


def test_evaluate_cli_on_real_subset(trained, tmp_path, capsys):
    out, _ = trained
    report_path = tmp_path / "eval.json"
    code = evaluate_main(["--artifact", str(out), "--dataset", "arc_challenge", "--split", "test", "--limit", "6",
                          "--output", str(report_path), "--no-progress"])
    assert code == 0
    report = json.loads(report_path.read_text())
    for key in ("accuracy", "ece", "ece_10", "ece_25", "ece_35", "nll", "brier", "aurc"):
        assert key in report
    assert report["n"] == 6 and report["dataset"] == "arc_challenge"
    png = report_path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(capsys.readouterr().out)["accuracy"] == report["accuracy"]


def test_evaluate_cli_bad_input(tmp_path, capsys):
    assert evaluate_main(["--artifact", str(tmp_path), "--dataset", "sciq", "--limit", "2"]) == 2
    assert "manifest.json not found" in capsys.readouterr().err
    assert evaluate_main(["--artifact", str(tmp_path), "--dataset", "nope"]) == 2
