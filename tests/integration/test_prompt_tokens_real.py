"""A pass's prompts tokenised in one call (Predictor._encode_all) give the ids tokenising each alone gives, with the
real SmolLM2 tokenizer and the default's chat template, on real questions of every built-in dataset (RACE's long
passages shortened to fit)."""

import pytest

from ibedl.core.predictor import Predictor
from ibedl.training.data import load_dataset
from tests.integration.conftest import DEFAULT_ARTIFACT


@pytest.fixture(scope="module")
def predictor(real_model_ref):
    return Predictor.from_artifact(DEFAULT_ARTIFACT)


@pytest.mark.parametrize("dataset, split", [("sciq", "train"), ("race", "test"), ("arc_easy", "test"),
                                            ("arc_challenge", "test"), ("obqa", "test")])
def test_one_call_gives_the_ids_one_call_each_gives(predictor, dataset, split):
    questions = load_dataset(dataset, split, limit=300, seed=0)
    alone = [predictor._encode_one(i, q, True) for i, q in enumerate(questions)]
    assert predictor._encode_all(questions, True) == alone
    if dataset == "race":  # some passages are past the limit: shortened the same way
        assert any(len(ids) < predictor.count_tokens(q) for ids, q in zip(alone, questions, strict=True))
