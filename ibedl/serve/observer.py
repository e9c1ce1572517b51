"""What the service records of the engine's work (an ``ibedl.engine.observer.Observer``): the Prometheus metrics,
and each adapter's drift monitor and label-free accuracy estimate (``GET /v1/drift``)."""

from __future__ import annotations

from dataclasses import dataclass

from ibedl.engine.drift import AccuracyEstimate, DriftMonitor
from ibedl.engine.observer import Observer
from ibedl.engine.schemas import DriftStatus
from ibedl.serve.metrics import Metrics


@dataclass
class Monitors:
    """What the service watches per adapter: its drift monitor and the running estimate of its accuracy."""

    drift: DriftMonitor
    accuracy: AccuracyEstimate
    options: int | None  # the option count whose answers they watch (None: every count)


class ServiceObserver(Observer):
    """The metrics and monitors of one service. ``settings``: the drift window, alarm rate and bootstrap."""

    def __init__(self, settings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.monitors: dict[str, Monitors] = {}  # by adapter name: the served runtime's

    def serving(self, runtime) -> None:
        """Fresh monitors against the calibration's reference, and the gauges that say which version is served.
        They watch the answers of the reference's option count alone (``runtime.watched_options``): another count's
        confidence and uncertainty differ on healthy traffic, and alarmed on a mixture. The accuracy target is that
        count's, and none where the calibration claims no promise for it."""
        s, target, options = self.settings, runtime.thresholds.stated_target, runtime.watched_options
        claimed = runtime.option_counts
        if claimed is not None and (options not in claimed if options is not None else not claimed):
            target = None
        self.monitors[runtime.name] = Monitors(
            DriftMonitor(runtime.reference(), runtime.drift_statistic, s.drift_window, s.drift_alarm_rate,
                         s.drift_bootstrap),
            AccuracyEstimate(s.drift_window, float(target) if target else None), options)
        manifest, base = runtime.predictor.manifest, runtime.predictor.manifest.base_model_ref()
        self.metrics.model_info.labels(adapter=runtime.name).info(
            {"version": str(manifest.version), "method": manifest.method, "base_model": base.name,
             "base_sha256": base.sha256[:12]})
        self.drift_status(runtime.name)

    def estimated(self, per_token_s: float) -> None:
        self.metrics.seconds_per_token.set(per_token_s)

    def readiness(self, ready: bool) -> None:
        self.metrics.ready.set(1 if ready else 0)

    def answered(self, runtime, question, prediction, answer) -> None:
        m, name, monitors = self.metrics, runtime.name, self.monitors[runtime.name]
        m.answers.labels(adapter=name).inc()
        m.confidence.labels(adapter=name).observe(prediction.confidence)
        m.predictions.labels(adapter=name, letter=prediction.letter).inc()
        if prediction.uncertainty is not None:
            m.uncertainty.labels(adapter=name).observe(prediction.uncertainty)
        if answer.guarantees is not None and answer.guarantees.holds is False:
            m.uncalibrated_options.labels(adapter=name, options=str(question.num_options),
                                          reason=answer.guarantees.reason).inc()
        if answer.abstain_reason:
            m.abstentions.labels(adapter=name, reason=answer.abstain_reason).inc()
        if monitors.options is not None and question.num_options != monitors.options:
            return  # another count than the reference's: not comparable with it
        # an answered question feeds the accuracy estimate, unless under the request's own thresholds (its guarantees
        # hold, the target is certified, yet no accuracy is stated: those answer other questions than the target's);
        # every one feeds drift
        own_thresholds = (monitors.accuracy.target is not None and answer.guarantees is not None
                          and answer.guarantees.holds is not False and answer.guarantees.answered_accuracy is None)
        if not answer.abstain_reason and not own_thresholds:
            monitors.accuracy.add([prediction.confidence])
        drift = monitors.drift
        drift.add([prediction.uncertainty if drift.statistic == "uncertainty_mass" else prediction.confidence])

    def refused(self, reason: str, count: int) -> None:
        self.metrics.rejected.labels(reason=reason).inc(count)

    def model_error(self, count: int, request_id: str) -> None:
        self.metrics.nonfinite.inc(count)

    def batch(self, size: int, seconds: float, per_token_s: float, overrun: float) -> None:
        self.metrics.batch_size.observe(size)
        self.metrics.forward_seconds.observe(seconds)
        self.metrics.seconds_per_token.set(per_token_s)
        self.metrics.admission_overrun.set(overrun)

    def depth(self, questions: int) -> None:
        self.metrics.queue_depth.set(questions)

    def switched(self, adapter: str, old: str, new: str) -> None:
        self.metrics.backend_switches.labels(adapter=adapter, **{"from": old, "to": new}).inc()

    def labels(self, results: list) -> None:
        for r in results:
            self.metrics.feedback_labels.labels(adapter=r.adapter, status=r.status).inc()

    def conflicts(self, adapters: tuple[str, ...]) -> None:
        for adapter in adapters:
            self.metrics.feedback_conflicts.labels(adapter=adapter).inc()

    def guarantees(self, rows: list[dict]) -> None:
        self.metrics.set_guarantees(rows)

    def drift_status(self, adapter: str) -> DriftStatus:
        """The adapter's drift monitor's and accuracy estimate's status, also set on their gauges."""
        monitors = self.monitors[adapter]
        status, accuracy = monitors.drift.status(), monitors.accuracy.status()
        self.metrics.set_drift(adapter, status)
        self.metrics.set_accuracy(adapter, accuracy)
        return DriftStatus(**status, **accuracy, options=monitors.options)
