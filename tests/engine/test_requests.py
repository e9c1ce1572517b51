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
