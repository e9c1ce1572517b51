import sys

import pytest

from ibedl.engine.errors import InvalidRequest
from ibedl.engine.requests import blank
from tests.engine.conftest import engine_with


def test_blank_means_whitespace_only():
    """NOT_BLANK spells out str.isspace(): one character is blank exactly when Python calls it whitespace."""
    assert [c for c in map(chr, range(sys.maxunicode + 1)) if blank(c) != c.isspace()] == []
    assert blank("") and blank(" \t\u3000") and not blank(" a ") and not blank("\ufeff")


def test_the_check_and_the_answer_read_the_same_per_count_quantiles(tiny_artifact):
    """A conformal pair stored pooled but not for the question's option count is refused by the check, before the
    model runs (it was checked against the pooled quantiles and failed in the answer, after the model had run);
    a count without its own quantiles is answered with the pooled ones."""
    engine, passes = engine_with(tiny_artifact)
    try:
        conformal = engine.default.conformal
        assert 0.05 in conformal.alphas()
        conformal.by_options = {"3": {"quantiles": {conformal.score: {"0.1": 0.5}}, "n": 50}}
        three = {"question": "Which is sun?", "options": ["sun", "moon", "tree"], "conformal": {"alpha": 0.05}}
        with pytest.raises(InvalidRequest, match="no stored prediction set for alpha 0.05") as refused:
            engine.predict([three])
        assert refused.value.field == "items.0.conformal" and passes == []
        answer = engine.predict([{**three, "conformal": {"alpha": 0.1}}])[0]  # the count's own quantile
        assert answer.prediction_set_coverage in (None, 0.9) and [len(p) for p in passes] == [1]
        four = {**three, "options": ["sun", "moon", "tree", "star"]}  # no own quantiles: the pooled ones
        assert engine.predict([four])[0].prediction_set is not None and [len(p) for p in passes] == [1, 1]
    finally:
        engine.close()


def test_a_batch_requests_prompts_are_tokenised_in_one_call_and_checked_in_order(tiny_artifact, monkeypatch):
    """The check of a request of several items tokenises their prompts in one call (each item's ids as alone), counts
    each against the token limit by its own position, and refuses an item's bad field before any tokenising."""
    from ibedl.core.predictor import prompt_ids
    from ibedl.engine.errors import TooLarge
    from ibedl.engine.schemas import PredictRequest
    from tests.conftest import tokenizer_calls

    engine, _ = engine_with(tiny_artifact)  # its limit: 96 tokens a prompt
    try:
        items = [PredictRequest(question=f"Which is {w}?", options=["sun", "moon", w], context=c)
                 for w, c in (("tree", None), ("star", "Stars shine."), ("rock", None))]
        predictor = engine.default.predictor
        calls = tokenizer_calls(monkeypatch, predictor.tokenizer)
        checked = engine.check_request(items)
        assert len(calls) == 1 and isinstance(calls[0], list) and len(calls[0]) == 3
        monkeypatch.undo()
        for c in checked:
            assert list(c.question.prompt_ids) == prompt_ids(predictor.tokenizer, predictor.template, c.question)
            assert c.tokens == len(c.question.prompt_ids) and c.runtime is engine.default
        long = PredictRequest(question="Which?", options=["a", "b"], context="word " * 200)
        with pytest.raises(TooLarge, match="the limit is 96") as refused:
            engine.check_request([items[0], long, long])
        assert refused.value.field == "items.1.context"
        calls = tokenizer_calls(monkeypatch, predictor.tokenizer)
        with pytest.raises(InvalidRequest) as refused:
            engine.check_request([long, PredictRequest(question=" ", options=["a", "b"])])
        assert refused.value.field == "items.1.question" and calls == []
    finally:
        engine.close()
