"""Admission on its own: a fake clock and hand-made queue snapshots, every refusal and its order."""

import pytest

from ibedl.engine.admission import Admission, InvalidTimeout, QueueSnapshot
from ibedl.engine.errors import NeedsTooLong, QueueFull


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def queue(**changes) -> QueueSnapshot:
    base = {"depth": 0, "queue_size": 8, "expected_wait_s": 1.0, "alone_s": 1.0}
    return QueueSnapshot(**{**base, **changes})


class TestDeadline:
    def test_the_shorter_of_the_servers_timeout_and_the_clients(self):
        admission = Admission(request_timeout_s=30, clock=Clock())
        assert admission.deadline(10.0, None) == 40.0
        assert admission.deadline(10.0, "2.5") == 12.5
        assert admission.deadline(10.0, "300") == 40.0

    @pytest.mark.parametrize("header", ["soon", "0", "-1", "nan", "inf", ""])
    def test_a_bad_header_is_refused_naming_it(self, header):
        message = f"X-Request-Timeout must be a positive number of seconds, got {header!r}"
        with pytest.raises(InvalidTimeout, match=message):
            Admission(request_timeout_s=30).deadline(0.0, header)


class TestBusyFor:
    def test_seconds_until_the_smallest_request_fits(self):
        clock = Clock(100.0)
        admission = Admission(request_timeout_s=10, margin=2.0, clock=clock)
        # arrived at 100, due at 110; the smallest request waits 3 s x margin 2 = 6 s: fits
        assert admission.busy_for(100.0, None, 3.0) is None
        clock.now = 106.0  # 4 s left, 6 s needed: 2 s too early
        assert admission.busy_for(100.0, None, 3.0) == pytest.approx(2.0)
        assert admission.busy_for(106.0, "1", 3.0) == pytest.approx(5.0)  # the client's 1 s deadline

    def test_an_invalid_header_is_left_to_the_route(self):
        assert Admission(request_timeout_s=10, clock=Clock()).busy_for(0.0, "soon", 1e9) is None


class TestDecide:
    def test_admits_what_fits_before_its_deadline(self):
        admission = Admission(margin=1.5, clock=Clock(0.0))
        assert admission.decide(2, 100, 1.6, queue(expected_wait_s=1.0, alone_s=0.5)) is None  # 1.5 <= 1.6
        assert admission.decide(2, 100, float("inf"), queue(expected_wait_s=1e6, alone_s=1e6)) is None

    def test_capacity_with_the_seconds_after_which_it_would_fit(self):
        admission = Admission(margin=1.5, clock=Clock(0.0))
        refusal = admission.decide(1, 10, 1.0, queue(expected_wait_s=1.0, alone_s=0.1, overrun=2.0))
        assert refusal.reason == "capacity" and refusal.wait_s == pytest.approx(1.5 * 2.0 * 1.0 - 1.0)
        assert refusal.retry_after == 2  # whole seconds, rounded up
        assert "expected in 3.0 s and the deadline leaves 1.0 s" in refusal.message

    def test_a_request_with_nothing_ahead_of_it_that_fits_alone_is_admitted_whatever_the_overrun(self):
        admission = Admission(margin=1.5, clock=Clock(0.0))
        lone = queue(depth=0, expected_wait_s=0.5, alone_s=0.5, overrun=4.0)  # 1.5 x 4 x 0.5 = 3 s > 2 s left
        assert admission.decide(1, 50, 2.0, lone) is None  # 1.5 x 0.5 = 0.75 s alone fits
        behind = queue(depth=1, expected_wait_s=0.6, alone_s=0.5, overrun=4.0)  # a question ahead: the overrun counts
        assert admission.decide(1, 50, 2.0, behind).reason == "capacity"
        in_flight = queue(depth=0, expected_wait_s=0.6, alone_s=0.5, overrun=4.0)  # a pass in flight
        assert admission.decide(1, 50, 2.0, in_flight).reason == "capacity"
        assert isinstance(admission.decide(1, 50, 0.5, lone), NeedsTooLong)  # alone it does not fit: still refused

    def test_too_large_even_alone_comes_before_capacity(self):
        refusal = Admission(clock=Clock(0.0)).decide(1, 500, 2.0, queue(expected_wait_s=9.0, alone_s=5.0))
        message = "the request needs about 5.0 s of model time (500 prompt tokens) and its deadline leaves 2.0 s"
        assert isinstance(refusal, NeedsTooLong) and refusal.reason == "capacity"
        assert refusal.cause == message and refusal.wait_s == pytest.approx(3.0)

    def test_queue_full_before_time(self):
        refusal = Admission(clock=Clock(0.0)).decide(3, 3, 100.0, queue(depth=6, queue_size=8))
        assert isinstance(refusal, QueueFull) and refusal.reason == "queue_full"
        assert "(6 questions are waiting; the queue holds 8)" in refusal.message
        assert Admission(clock=Clock(0.0)).decide(2, 2, 100.0, queue(depth=6, queue_size=8)) is None

    def test_shutting_down_first_unless_admitted_before_the_drain(self):
        admission = Admission(clock=Clock(10.0))
        draining = queue(draining=True, drain_end=20.0, depth=8, queue_size=8)
        assert admission.decide(1, 1, 100.0, draining).reason == "shutting_down"
        # admitted before the drain began: still checked against the queue and the drain's end
        assert admission.decide(1, 1, 100.0, draining, admitted_before_drain=True).reason == "queue_full"
        room = queue(draining=True, drain_end=20.0, expected_wait_s=9.0)
        assert admission.decide(1, 1, 100.0, room, admitted_before_drain=True) is None  # 9 s of 10 left
        late = queue(draining=True, drain_end=20.0, expected_wait_s=11.0)
        refusal = admission.decide(1, 1, 100.0, late, admitted_before_drain=True)
        assert refusal.reason == "shutting_down" and "in time" in refusal.message
        assert admission.decide(1, 1, 100.0, queue(stopping=True), admitted_before_drain=True).reason == "shutting_down"


@pytest.mark.parametrize("kwargs, message", [({"margin": 0.5}, "margin must be >= 1, got 0.5"),
                                             ({"request_timeout_s": 0}, "request_timeout_s must be > 0, got 0")])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Admission(**kwargs)
