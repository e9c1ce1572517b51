"""Laplace-LoRA on the tiny model: a KFAC posterior over the LoRA weights and its GLM predictive."""

import json
import random

import numpy as np
import pytest

from evidential.predictor import Predictor
from training.config import load_config
from training.data import load_dataset
from training.finetune import train
from training.laplace_lora import fit_laplace

WORDS = "sun moon water plant stone tree bird fish cloud river".split()


@pytest.fixture(scope="module")
def map_artifact(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("laplace")
    rng = random.Random(0)
    data = root / "toy.jsonl"
    data.write_text("".join(json.dumps({"question": f"Which is {o[0]}?", "options": o, "answer": 0}) + "\n"
                            for o in (rng.sample(WORDS, rng.choice([3, 4])) for _ in range(40))))
    cfg = load_config(None, ["method=map", f"base_model={tiny_model_dir}", f"output={root / 'map'}", "progress=false",
                             f"data={{train: [{{dataset: jsonl, path: {data}}}], validation: [{{dataset: jsonl, path: {data}, limit: 8}}]}}",
                             "optim.max_steps=4", "optim.lr=1e-2", "max_tokens=96"])
    return train(cfg), data


def test_glm_predictive_is_a_distribution_and_flatter_than_map(map_artifact):
    artifact, data = map_artifact
    questions = load_dataset("jsonl", "test", path=data)
    predictor = Predictor.from_artifact(artifact)
    map_probs = [p.probs for p in predictor.predict(questions[20:32])]
    la = fit_laplace(predictor, questions[:20])
    assert float(la.la.prior_precision) > 0
    probs, seconds = la.predict(questions[20:32], batch_size=4)
    assert seconds > 0 and len(probs) == 12
    for p, q, m in zip(probs, questions[20:32], map_probs):
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
    from evidential.prompt import MCQuestion

    with pytest.raises(ValueError, match="needs questions with answers"):
        fit_laplace(predictor, [MCQuestion(q.question, q.options)])
