"""The per-token time estimate and the fair-share wait, against their closed forms."""

import pytest

from service.capacity import ServiceTime, fair_share_wait


def test_first_pass_replaces_an_unknown_estimate_then_weights_recent_passes():
    st = ServiceTime(weight=0.5)
    st.observe(100, 2.0)
    assert st.per_token_s == pytest.approx(0.02)
    st.observe(100, 4.0)
    assert st.per_token_s == pytest.approx(0.5 * 0.02 + 0.5 * 0.04)
    assert st.seconds(50) == pytest.approx(50 * 0.03)


def test_a_prior_is_blended_not_replaced():
    st = ServiceTime(0.01, weight=0.2)
    st.observe(10, 1.0)
    assert st.per_token_s == pytest.approx(0.8 * 0.01 + 0.2 * 0.1)


def test_empty_or_broken_passes_are_ignored():
    st = ServiceTime(0.01)
    st.observe(0, 1.0)
    st.observe(10, float("nan"))
    st.observe(10, float("inf"))
    assert st.per_token_s == 0.01 and st.passes == 0


def test_fair_share_wait_counts_each_queued_request_up_to_the_new_ones_size():
    st = ServiceTime(0.1)
    # queued 50, 3 and 10 tokens; a new 8-token request waits for 8 + 3 + 8 of them and its own 8
    assert fair_share_wait(8, [50, 3, 10], 0.4, st) == pytest.approx(0.4 + 0.1 * (8 + 3 + 8 + 8))
    assert fair_share_wait(8, [], 0.0, st) == pytest.approx(0.8)


@pytest.mark.parametrize("kwargs, message", [({"per_token_s": -1}, "per_token_s"), ({"per_token_s": float("nan")}, "per_token_s"),
                                             ({"weight": 0}, "weight"), ({"weight": 1.5}, "weight")])
def test_bad_arguments_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServiceTime(**kwargs)
