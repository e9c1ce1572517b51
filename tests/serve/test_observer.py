"""The service's observer (ibedl.serve.observer): its drift monitor and label-free accuracy estimate watch the answers
of the option count the calibration's reference was drawn from, and state a target only where the calibration
claims that count."""

from types import SimpleNamespace

import numpy as np
import pytest

from ibedl.core.artifact import Abstention
from ibedl.serve.observer import ServiceObserver
from ibedl.serve.settings import Settings

WINDOW = 100


def runtime(options: int | None, claimed: list[int] | None = None, reference=None):
    """A served adapter whose 4-option reference uncertainty is ~U(0.2, 0.4), drawn from ``options`` questions."""
    rng = np.random.default_rng(0)
    manifest = SimpleNamespace(version=3, method="ib_edl",
                               base_model_ref=lambda: SimpleNamespace(name="base", sha256="0" * 64))
    return SimpleNamespace(
        name="a", watched_options=options, option_counts=claimed, drift_statistic="uncertainty_mass",
        thresholds=Abstention(min_confidence=0.5, how={"target_accuracy": 0.9, "certified": True}),
        reference=lambda: list(rng.uniform(0.2, 0.4, 500)) if reference is None else reference,
        predictor=SimpleNamespace(manifest=manifest))


def answer(observer, served, num_options: int, u: float, confidence: float = 0.9) -> None:
    observer.answered(served, SimpleNamespace(num_options=num_options),
                      SimpleNamespace(confidence=confidence, letter="A", uncertainty=u),
                      SimpleNamespace(guarantees=None, abstain_reason=None))


def test_other_option_counts_are_not_compared_with_the_reference():
    """Healthy traffic, 80% four options like the reference and 20% two options (u = C / alpha0 is lower with fewer
    options): watched on four options it stays quiet; pooled it alarms, though nothing drifted."""
    rng = np.random.default_rng(1)
    traffic = [(2, u / 2) if rng.random() < 0.2 else (4, u) for u in rng.uniform(0.2, 0.4, 3 * WINDOW)]
    for options, alarms in ((4, False), (None, True)):
        observer = ServiceObserver(Settings(drift_window=WINDOW))
        served = runtime(options, [2, 4])
        observer.serving(served)
        for count, u in traffic:
            answer(observer, served, count, u)
        status = observer.drift_status("a")
        assert status.alarm is alarms and status.options == options
        assert status.window == status.answered_in_window == WINDOW
        last = [u for count, u in traffic if options is None or count == options][-WINDOW:]
        assert status.window_mean == pytest.approx(np.mean(last))  # the window holds exactly the watched answers


@pytest.mark.parametrize(("options", "claimed", "target"), [
    (4, [2, 3, 4], 0.9), (4, [2, 3], None), (4, [], None), (None, [], None), (None, [4], 0.9), (4, None, 0.9)])
def test_the_target_is_stated_only_for_a_claimed_count(options, claimed, target):
    """A calibration that claims no promise for the watched count (too few of its questions) has no target on the
    gauge the accuracy alert compares with, though its thresholds were certified on the pooled sample."""
    observer = ServiceObserver(Settings(drift_window=WINDOW))
    observer.serving(runtime(options, claimed))
    assert observer.drift_status("a").target_accuracy == target
    gauge = observer.metrics.target_accuracy.labels(adapter="a")._value.get()
    assert gauge == target if target is not None else np.isnan(gauge)


def test_answers_under_a_requests_own_thresholds_stay_out_of_the_accuracy_estimate():
    """Such an answer states no accuracy (its questions are not the certified threshold's); its confidence, higher by
    the request's choice, would lift the estimate compared with that target. A suspended version's answers (holds
    false) still count: the estimate is label-free."""
    observer = ServiceObserver(Settings(drift_window=WINDOW))
    served = runtime(4, [4])
    observer.serving(served)

    def answered(confidence: float, holds, accuracy) -> None:
        observer.answered(served, SimpleNamespace(num_options=4),
                          SimpleNamespace(confidence=confidence, letter="A", uncertainty=0.3),
                          SimpleNamespace(guarantees=SimpleNamespace(holds=holds, answered_accuracy=accuracy,
                                                                     reason=None), abstain_reason=None))

    answered(0.6, True, 0.9)  # the adapter's own rule
    answered(0.99, True, None)  # a request's own thresholds: not counted
    answered(0.7, False, None)  # a suspended version: counted
    status = observer.drift_status("a")
    assert status.answered_in_window == 2 and status.estimated_accuracy == pytest.approx(0.65)
    assert status.window == 3  # drift sees every answer


def test_an_older_calibration_watches_its_one_claimed_count():
    """Before reference.options was recorded: the post-hoc step's count for a per-count calibration, else the one
    claimed count (a calibration that is not per count claims one only when its sample held that count alone)."""
    from ibedl.engine.runtime import AdapterRuntime

    def watched(reference: dict, record: dict, claimed):
        this = SimpleNamespace(calibration=SimpleNamespace(reference=reference, record=record), option_counts=claimed)
        return AdapterRuntime.watched_options.fget(this)

    assert watched({"options": 5}, {}, [4, 5]) == 5
    assert watched({"options": None}, {}, [4]) is None  # recorded: a mixture
    assert watched({}, {"posthoc": {"fitted_on_options": 4}}, [2, 3, 4]) == 4
    assert watched({}, {"posthoc": {"kind": "zeta"}}, [4]) == 4  # artifacts/map-twin's
    assert watched({}, {}, []) is None and watched({}, {}, None) is None
