"""The Laplace prior-precision benchmark on a tiny MAP run: validation metrics over the grid, marglik and MAP."""

import json
import random

import numpy as np
import pytest

from benchmarks.laplace_prior import main
from ibedl.core.predictor import Predictor
from ibedl.training import metrics
from ibedl.training.config import load_config
from ibedl.training.finetune import run_questions, train
from ibedl.training.laplace_lora import PRIOR_GRID

WORDS = ["sun", "moon", "water", "plant", "stone", "tree", "bird", "fish", "cloud", "river"]


@pytest.fixture(scope="module")
def map_run(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("laplace-prior")
    rng = random.Random(0)
    data = root / "toy.jsonl"
    data.write_text("".join(json.dumps({"question": f"Which is {o[0]}?", "options": o, "answer": 0}) + "\n"
                            for o in (rng.sample(WORDS, rng.choice([3, 4])) for _ in range(30))))
    cfg = load_config(None, [
        "method=map", f"output={root / 'map'}", f"base_model={tiny_model_dir}", "progress=false", "max_tokens=96",
        f"data={{train: [{{dataset: jsonl, path: {data}, limit: 20}}], "
        f"validation: [{{dataset: jsonl, path: {data}, limit: 8}}]}}",
        "optim.max_steps=4", "optim.lr=1e-2", "lora.targets=[q_proj, v_proj]"])
    return train(cfg)


def test_validation_metrics_over_the_grid_marglik_and_map(map_run, tmp_path, capsys):
    out = tmp_path / "prior.json"
    assert main(["--run", str(map_run), "--fit-samples", "12", "--output", str(out)]) == 0
    [run] = json.loads(out.read_text())["runs"]
    assert run["fit_questions"] == 12 and run["validation_questions"] == 8
    assert [g["prior_precision"] for g in run["grid"]] == pytest.approx(list(PRIOR_GRID))
    # the validation choice is the grid's lowest NLL; MAP's row is the saved adapter's own softmax
    choice = run["validation_choice"]
    assert choice["nll"] == min(g["nll"] for g in run["grid"]) and choice["prior_precision"] in PRIOR_GRID
    _, _, val_q = run_questions(Predictor.from_artifact(map_run).manifest.training)
    probs = [p.probs for p in Predictor.from_artifact(map_run).predict(val_q)]
    expected = metrics.summarise(probs, [q.answer for q in val_q])
    for key in ("nll", "ece", "accuracy", "mean_confidence"):
        assert run["map"][key] == pytest.approx(expected[key], abs=1e-5)
    # a wider posterior flattens the predictive: mean confidence falls as the prior precision falls
    conf = np.array([g["mean_confidence"] for g in run["grid"]])
    assert conf[0] <= conf[-1] and conf[-1] == pytest.approx(run["map"]["mean_confidence"], abs=1e-3)
    assert run["marglik"]["prior_precision"] > 0
    assert "marglik" in capsys.readouterr().out


def test_a_missing_run_is_reported(tmp_path, capsys):
    assert main(["--run", str(tmp_path / "nope")]) == 2
    assert "no trained run at" in capsys.readouterr().err
