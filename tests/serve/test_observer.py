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
