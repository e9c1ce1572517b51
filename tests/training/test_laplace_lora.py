"""Laplace-LoRA on the tiny model: a KFAC posterior over the LoRA weights, its prior precision and its GLM
predictive."""

import json
import random

import numpy as np
import pytest

from ibedl.core.predictor import Predictor
from ibedl.training.config import load_config
from ibedl.training.data import load_dataset
from ibedl.training.finetune import train
from ibedl.training.laplace_lora import PRIOR_GRID, choose_prior_on_validation, fit_laplace

WORDS = ["sun", "moon", "water", "plant", "stone", "tree", "bird", "fish", "cloud", "river"]


@pytest.fixture(scope="module")
def map_artifact(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("laplace")
    rng = random.Random(0)
    data = root / "toy.jsonl"
    data.write_text("".join(json.dumps({"question": f"Which is {o[0]}?", "options": o, "answer": 0}) + "\n"
                            for o in (rng.sample(WORDS, rng.choice([3, 4])) for _ in range(40))))
    cfg = load_config(None, ["method=map", f"output={root / 'map'}", *tiny_overrides(tiny_model_dir, data)])
    return train(cfg), data


def tiny_overrides(tiny_model_dir, data) -> list[str]:
    return [f"base_model={tiny_model_dir}", "progress=false",
            f"data={{train: [{{dataset: jsonl, path: {data}}}], "
            f"validation: [{{dataset: jsonl, path: {data}, limit: 8}}]}}",
            "optim.max_steps=4", "optim.lr=1e-2", "max_tokens=96"]


def test_glm_predictive_is_a_distribution_and_flatter_than_map(map_artifact):
    artifact, data = map_artifact
    questions = load_dataset("jsonl", "test", path=data)
    predictor = Predictor.from_artifact(artifact)
    map_probs = [p.probs for p in predictor.predict(questions[20:32])]
    la = fit_laplace(predictor, questions[:20], prior_precision="marglik")
    assert float(la.la.prior_precision) > 0 and la.prior_info["prior"] == "marglik"
    probs, seconds = la.predict(questions[20:32], batch_size=4)
    assert seconds > 0 and len(probs) == 12
    for p, q, m in zip(probs, questions[20:32], map_probs, strict=True):
        assert len(p) == q.num_options
        assert sum(p) == pytest.approx(1.0, abs=1e-6)
        # the probit predictive shrinks the logits: max probability never above MAP's (+ rounding)
        assert max(p) <= max(m) + 1e-4
    entropy = lambda rows: float(np.mean([-(np.array(r) * np.log(np.array(r))).sum() for r in rows]))  # noqa: E731
    assert entropy(probs) >= entropy(map_probs) - 1e-6


def test_needs_answers(map_artifact):
    artifact, data = map_artifact
    predictor = Predictor.from_artifact(artifact)
    q = load_dataset("jsonl", "test", path=data)[0]
    from ibedl.core.prompt import MCQuestion

    with pytest.raises(ValueError, match="needs questions with answers"):
        fit_laplace(predictor, [MCQuestion(q.question, q.options)])



def test_finetune_method_laplace_trains_map_then_fits_the_posterior(map_artifact, tiny_model_dir, tmp_path):
    from ibedl.training.evaluate import evaluate

    _, data = map_artifact
    # prior chosen on the 8 validation questions (the default): recorded in the manifest
    cfg = load_config(None, ["method=laplace", f"output={tmp_path / 'chosen'}", "method_params={fit_samples: 12}",
                             *tiny_overrides(tiny_model_dir, data)])
    chosen = json.loads((train(cfg) / "manifest.json").read_text())["training"]["posthoc"]
    assert chosen["prior"] == "validation" and chosen["validation_questions"] == 8 and chosen["fit_questions"] == 12
    assert chosen["prior_precision"] in PRIOR_GRID and chosen["validation_nll"] <= chosen["validation_nll_map"] + 1e-6
    # a given (small) prior precision: a posterior wide enough to move the validation metrics off MAP's
    cfg = load_config(None, ["method=laplace", f"output={tmp_path / 'laplace'}",
                             "method_params={fit_samples: 12, prior_precision: 0.1}",
                             *tiny_overrides(tiny_model_dir, data)])
    artifact = train(cfg)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["method"] == "laplace" and manifest["method_config"]["fit_samples"] == 12
    assert manifest["training"]["posthoc"]["prior"] == "given"
    assert manifest["head"]["kind"] == "softmax" and manifest["mc_samples"] == 0
    assert manifest["reference"]["uncertainty"] is None  # not a Dirichlet
    # The manifest's validation metrics are the GLM predictive's, not the saved MAP adapter's own.
    validation = load_dataset("jsonl", "validation", path=data, limit=8, seed=0)
    map_metrics = evaluate(Predictor.from_artifact(artifact), validation, progress=False).metrics
    assert manifest["metrics"]["validation"]["nll"] != pytest.approx(map_metrics["nll"], abs=1e-6)
    assert set(manifest["metrics"]["validation"]) == set(map_metrics)


def test_laplace_hyper_parameters_checked_on_arrival():
    from ibedl.training.methods import get_method

    with pytest.raises(ValueError, match="fit_samples must be an integer >= 1, got 0"):
        get_method("laplace").params({"fit_samples": 0})
    with pytest.raises(ValueError, match=r"prior_precision must be one of \(.validation., .marglik.\) "
                       r"or a finite number > 0, got -1"):
        get_method("laplace").params({"prior_precision": -1})
    with pytest.raises(ValueError, match="got 'map'"):
        get_method("laplace").params({"prior_precision": "map"})
    assert get_method("laplace").params({})["prior_precision"] == "validation"


def test_posterior_over_the_live_layers_of_a_prefix_cached_trunk(map_artifact, tmp_path, monkeypatch):
    from ibedl.core import prefix_cache

    monkeypatch.setenv("IBEDL_CACHE_DIR", str(tmp_path))
    artifact, data = map_artifact
    questions = load_dataset("jsonl", "test", path=data)
    full = fit_laplace(Predictor.from_artifact(artifact), questions[:20], prior_precision="marglik")
    full = full.predict(questions[20:28], batch_size=4)[0]
    predictor = Predictor.from_artifact(artifact)
    trunk = prefix_cache.attach(predictor, 1, "sha")  # the tiny model has 2 layers: layer 0 cached
    la = fit_laplace(predictor, questions[:20], prior_precision="marglik")
    live = [n for n, p in predictor.model.named_parameters() if p.requires_grad]
    assert live and all(prefix_cache.layer_index(n) == 1 for n in live)
    probs = la.predict(questions[20:28], batch_size=4)[0]  # Jacobians through the cached states (torch.func)
    assert list(tmp_path.rglob("*.safetensors")) and trunk.first == 1
    for p, q, f in zip(probs, questions[20:28], full, strict=True):
        assert len(p) == q.num_options and sum(p) == pytest.approx(1.0, abs=1e-6)
        # layer 0's LoRA leaves the posterior: the predictive is no wider than the one over both layers (+ rounding)
        assert max(p) >= max(f) - 1e-3


def test_mc_predictive_samples_the_posterior(map_artifact):
    artifact, data = map_artifact
    questions = load_dataset("jsonl", "test", path=data)
    predictor = Predictor.from_artifact(artifact)
    map_probs = [p.probs for p in predictor.predict(questions[20:28])]
    la = fit_laplace(predictor, questions[:20], prior_precision="marglik", predictive="mc", samples=8)
    probs = la.predict(questions[20:28], batch_size=4)[0]
    for p, q, _m in zip(probs, questions[20:28], map_probs, strict=True):
        assert len(p) == q.num_options and sum(p) == pytest.approx(1.0, abs=1e-6)
    # weight samples moved the answer distribution away from MAP's
    assert max(abs(a - b) for p, m in zip(probs, map_probs, strict=True) for a, b in zip(p, m, strict=True)) > 1e-4
    with pytest.raises(ValueError, match="predictive must be one of"):
        fit_laplace(predictor, questions[:20], prior_precision="marglik", predictive="laplace")


def test_glm_predictive_one_question_at_a_time_equals_laplace_torchs_batched_one(map_artifact):
    from ibedl.training.laplace_lora import _Batches

    artifact, data = map_artifact
    questions = load_dataset("jsonl", "test", path=data)
    predictor = Predictor.from_artifact(artifact)
    la = fit_laplace(predictor, questions[:20], prior_precision=0.5)
    assert la.prior_info == {"prior": "given", "prior_precision": 0.5, "fit_questions": 20}
    ours = la.predict(questions[20:28], batch_size=4)[0]
    ref = []  # laplace-torch's own GLM probit predictive, four questions a Jacobian
    for batch in _Batches(predictor, questions[20:28], 4, la.width).batches:
        glm = la.la(batch, pred_type="glm", link_approx="probit").detach()
        for row, mask in zip(glm, batch["option_mask"], strict=True):
            ref.append((row[mask] / row[mask].sum()).tolist())
    for a, b in zip(ours, ref, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_prior_chosen_on_validation_has_the_lowest_validation_nll_of_the_grid(map_artifact):
    artifact, data = map_artifact
    questions = load_dataset("jsonl", "test", path=data)
    validation = questions[28:40]
    predictor = Predictor.from_artifact(artifact)
    la = fit_laplace(predictor, questions[:20], validation=validation)
    info = la.prior_info
    assert info["prior"] == "validation" and info["validation_questions"] == 12 and info["fit_questions"] == 20
    assert info["prior_precision"] in PRIOR_GRID and float(la.la.prior_precision) == info["prior_precision"]

    def nll(value: float) -> float:
        la.la.prior_precision = value
        probs = la.predict(validation)[0]
        return -float(np.mean([np.log(p[q.answer]) for p, q in zip(probs, validation, strict=True)]))

    chosen = nll(info["prior_precision"])
    assert chosen == pytest.approx(info["validation_nll"], rel=1e-4)
    for value in PRIOR_GRID[::4]:
        assert chosen <= nll(value) + 1e-6
    # without the posterior (MAP): the NLL of the softmax itself, what a huge prior precision tends to
    assert info["validation_nll_map"] == pytest.approx(nll(1e12), rel=1e-3)


def test_prior_on_validation_needs_validation_questions_with_answers(map_artifact):
    from ibedl.core.prompt import MCQuestion

    artifact, data = map_artifact
    questions = load_dataset("jsonl", "test", path=data)
    predictor = Predictor.from_artifact(artifact)
    with pytest.raises(ValueError, match="prior_precision .validation. needs questions with answers, got none"):
        fit_laplace(predictor, questions[:20])
    with pytest.raises(ValueError, match="needs questions with answers, got 10 of 10 without an answer"):
        fit_laplace(predictor, questions[:20], validation=[MCQuestion(q.question, q.options) for q in questions[30:]])
    with pytest.raises(ValueError, match="got 'bayes'"):
        fit_laplace(predictor, questions[:20], prior_precision="bayes")
    with pytest.raises(ValueError, match="got -2"):
        fit_laplace(predictor, questions[:20], prior_precision=-2)
    with pytest.raises(ValueError, match="got True"):
        fit_laplace(predictor, questions[:20], prior_precision=True)
    la = fit_laplace(predictor, questions[:20], prior_precision=1.0)
    with pytest.raises(ValueError, match=r"grid must be finite numbers > 0, got \(\)"):
        choose_prior_on_validation(la, questions[30:], grid=())
    with pytest.raises(ValueError, match="got none"):
        choose_prior_on_validation(la, [])


def test_a_prior_at_the_grids_edge_is_flagged(map_artifact, caplog):
    artifact, data = map_artifact
    questions = load_dataset("jsonl", "test", path=data)
    la = fit_laplace(Predictor.from_artifact(artifact), questions[:20], prior_precision=1.0)
    # two values: whichever wins is an edge, named for where it is
    info = choose_prior_on_validation(la, questions[28:40], grid=(1e-3, 1e8))
    assert info["at_grid_edge"] == ("top" if info["prior_precision"] == 1e8 else "bottom")
    assert f"is the grid's {info['at_grid_edge']} value" in caplog.text
    assert choose_prior_on_validation(la, questions[28:40], grid=(3.0,))["at_grid_edge"] is None
