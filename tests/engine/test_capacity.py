"""The per-token time estimate and the fair-share wait, against their closed forms."""

import math

import pytest

from ibedl.engine.capacity import ServiceTime, round_robin_finish, round_robin_wait


def test_first_pass_replaces_an_unknown_estimate_then_moves_by_the_work_it_measured():
    st = ServiceTime(horizon_tokens=100)
    st.observe(100, 2.0)
    assert st.per_token_s == pytest.approx(0.02)
    w = 1 - math.exp(-1)  # a pass of 100 tokens against a horizon of 100
    st.observe(100, 4.0)
    assert st.per_token_s == pytest.approx(0.02 + w * (0.04 - 0.02))
    assert st.seconds(50) == pytest.approx(50 * st.per_token_s)


def test_a_small_pass_moves_the_estimate_less_than_a_large_one():
    small, large = ServiceTime(0.01, horizon_tokens=1000), ServiceTime(0.01, horizon_tokens=1000)
    small.observe(10, 10 * 0.05)
    large.observe(2000, 2000 * 0.05)
    assert small.per_token_s == pytest.approx(0.01 + (1 - math.exp(-0.01)) * 0.04)
    assert large.per_token_s == pytest.approx(0.01 + (1 - math.exp(-2)) * 0.04)


def test_empty_or_broken_passes_are_ignored():
    st = ServiceTime(0.01)
    st.observe(0, 1.0)
    st.observe(10, float("nan"))
    st.observe(10, float("inf"))
    assert st.per_token_s == 0.01 and st.passes == 0


def test_round_robin_wait_counts_the_turns_of_each_queued_request():
    st = ServiceTime(0.1)
    # a new request of 2 questions (8 and 4 tokens) waits for the first 2 questions of each queued request
    queued = [[50, 50, 50], [3], [10, 1]]
    assert round_robin_wait([8, 4], queued, 0.4, st) == pytest.approx(0.4 + 0.1 * (100 + 3 + 11 + 12))
    assert round_robin_wait([8], [], 0.0, st) == pytest.approx(0.8)


def test_round_robin_finish_serves_one_question_of_each_request_a_turn():
    st = ServiceTime(1.0)
    # turns: a1 b1 c1 | a2 c2 | a3   (1 s a token, 0.5 s left of the pass in flight)
    finish = round_robin_finish([[1, 1, 1], [2], [1, 3]], 0.5, st)
    assert finish == pytest.approx([0.5 + 1 + 2 + 1 + 1 + 3 + 1, 0.5 + 1 + 2, 0.5 + 1 + 2 + 1 + 1 + 3])
    assert round_robin_finish([], 0.5, st) == []


@pytest.mark.parametrize("kwargs, message", [({"per_token_s": -1}, "per_token_s"),
                                             ({"per_token_s": float("nan")}, "per_token_s"),
                                             ({"horizon_tokens": 0}, "horizon_tokens"),
                                             ({"horizon_tokens": float("inf")}, "horizon_tokens")])
def test_bad_arguments_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServiceTime(**kwargs)


def test_warm_up_prepares_a_trunk_before_its_probes(tiny_artifact):
    """A graphed trunk's graphs are all captured at warm-up (on the thread that serves: the engine's model thread
    runs warm_up), before its probes, so no served pass pays a capture."""
    import torch

    from ibedl.core.backends import Built
    from ibedl.core.backends.cuda_graphs import GraphedTrunk
    from ibedl.core.backends.torch_cuda import TorchTrunk
    from ibedl.core.predictor import Predictor
    from ibedl.engine.capacity import warm_up
    from tests.core.test_backends_cuda_graphs import Captures

    predictor = Predictor.from_artifact(tiny_artifact, device="cpu", dtype=torch.float32, backend="torch")
    captures = Captures()
    shapes = [(1, 64), (1, 128), (2, 128)]
    trunk = GraphedTrunk(TorchTrunk(predictor.model), shapes, captures)
    predictor.serve_on(Built(trunk, "torch-cuda-graphs-fp32"))
    estimate = warm_up([predictor])
    assert captures.shapes == [(2, 128), (1, 128), (1, 64)]  # all, largest first, before the probes replayed
    assert trunk.counts["replays"] == 2 and trunk.counts["eager"] == 0 and estimate.per_token_s > 0
