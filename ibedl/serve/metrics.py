"""Prometheus metrics of one app instance, in its own registry (prefix ``ibedl_``). What belongs to one served
adapter (answers, abstentions, predictions, confidence and uncertainty histograms, drift and accuracy gauges,
model info) carries an ``adapter`` label; the request, queue and forward-pass series are the shared model's."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

PROBABILITY_BUCKETS = tuple(round(x, 2) for x in [i / 20 for i in range(1, 21)])
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GUARANTEE_LABELS = ("adapter", "version", "guarantee", "stated")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ibedl_requests", "HTTP requests by route and status", ["route", "method", "status"],
                                registry=r)
        self.latency = Histogram("ibedl_request_latency_seconds", "request latency by route", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.inflight = Gauge("ibedl_inflight_requests", "requests being served", registry=r)
        self.batch_size = Histogram("ibedl_batch_size", "questions per forward pass", buckets=BATCH_BUCKETS, registry=r)
        self.queue_depth = Gauge("ibedl_queue_depth", "questions waiting for the model", registry=r)
        self.forward_seconds = Histogram("ibedl_forward_seconds", "model time per batch", buckets=LATENCY_BUCKETS,
                                         registry=r)
        self.rejected = Counter("ibedl_rejected", "questions refused or dropped before an answer, by reason",
                                ["reason"], registry=r)
        self.nonfinite = Counter("ibedl_nonfinite_outputs", "questions whose model outputs held NaN or inf (answered "
                                 "500 model_error, never as an answer)", registry=r)
        self.admission_overrun = Gauge("ibedl_admission_overrun", "how much longer than estimated recent requests "
                                       "took (>= 1); admission and shedding multiply their estimates by it", registry=r)
        self.seconds_per_token = Gauge("ibedl_seconds_per_token", "estimated model seconds per prompt token (the "
                                       "admission estimate, from recent forward passes)", registry=r)
        self.uncertainty = Histogram("ibedl_uncertainty_mass", "uncertainty mass u of served answers", ["adapter"],
                                     buckets=PROBABILITY_BUCKETS, registry=r)
        self.confidence = Histogram("ibedl_confidence", "max probability of served answers", ["adapter"],
                                    buckets=PROBABILITY_BUCKETS, registry=r)
        self.answers = Counter("ibedl_answers", "questions answered by the model (abstained or not)", ["adapter"],
                               registry=r)
        self.uncalibrated_options = Counter(
            "ibedl_answers_without_guarantee", "questions answered with no stated guarantee (guarantees.holds false), "
            "by option count and reason: option_count_not_calibrated, violated_by_feedback",
            ["adapter", "options", "reason"], registry=r)
        self.abstentions = Counter("ibedl_abstentions", "abstentions by the threshold crossed", ["adapter", "reason"],
                                   registry=r)
        self.predictions = Counter("ibedl_predictions", "predicted letters", ["adapter", "letter"], registry=r)
        self.drift_ks = Gauge("ibedl_drift_ks", "KS statistic of the window against the reference", ["adapter"],
                              registry=r)
        self.drift_psi = Gauge("ibedl_drift_psi", "population stability index of the window", ["adapter"], registry=r)
        self.drift_threshold = Gauge("ibedl_drift_ks_threshold", "KS alarm threshold (bootstrap)", ["adapter"],
                                     registry=r)
        self.drift_alarm = Gauge("ibedl_drift_alarm", "1 when the KS statistic of a full window exceeds the threshold",
                                 ["adapter"], registry=r)
        self.drift_window = Gauge("ibedl_drift_window", "values in the drift window", ["adapter"], registry=r)
        self.drift_window_mean = Gauge("ibedl_drift_window_mean", "mean of the monitored value in the window",
                                       ["adapter"], registry=r)
        self.drift_reference_mean = Gauge("ibedl_drift_reference_mean", "mean of the monitored value in the reference",
                                          ["adapter"], registry=r)
        self.accuracy_estimate = Gauge("ibedl_estimated_accuracy", "label-free estimate of answered accuracy in the "
                                       "window (mean calibrated confidence of answered questions)", ["adapter"],
                                       registry=r)
        self.accuracy_lower = Gauge("ibedl_estimated_accuracy_lower", "lower end of its 95% interval", ["adapter"],
                                    registry=r)
        self.accuracy_upper = Gauge("ibedl_estimated_accuracy_upper", "upper end of its 95% interval", ["adapter"],
                                    registry=r)
        self.accuracy_window = Gauge("ibedl_estimated_accuracy_window", "answered questions in the estimate's window",
                                     ["adapter"], registry=r)
        self.target_accuracy = Gauge("ibedl_target_accuracy", "accuracy the adapter's abstention guarantees",
                                     ["adapter"], registry=r)
        self.feedback_labels = Counter("ibedl_feedback_labels", "labels this replica received, by outcome: recorded "
                                       "(counted; the shared store keeps each receipt once) or duplicate",
                                       ["adapter", "status"], registry=r)
        self.feedback_conflicts = Counter("ibedl_feedback_conflicts", "labels this replica refused because their "
                                          "receipt was recorded before with another label (the first label stands)",
                                          ["adapter"], registry=r)
        # The realised guarantees of the served adapter versions, read from the feedback store: with a shared store
        # (IBEDL_FEEDBACK_DB) every replica reports the same totals and bounds, so aggregate across replicas with
        # max/min, never sum. A retired version (labelled, no longer served) has none: only what is served alarms.
        g = GUARANTEE_LABELS
        self.guarantee_labels = Gauge("ibedl_guarantee_labels", "labelled questions a realised guarantee counts "
                                      "(feedback store)", g, registry=r)
        self.guarantee_hits = Gauge("ibedl_guarantee_hits", "of them: right answers, covering sets or answered "
                                    "questions", g, registry=r)
        self.guarantee_lower = Gauge("ibedl_guarantee_lower", "lower end of the guarantee's confidence sequence",
                                     g, registry=r)
        self.guarantee_upper = Gauge("ibedl_guarantee_upper", "upper end of the guarantee's confidence sequence "
                                     "(valid under continuous monitoring)", g, registry=r)
        self.guarantee_stated = Gauge("ibedl_guarantee_stated", "the level the guarantee states (NaN: none)", g,
                                      registry=r)
        self.guarantee_change = Gauge("ibedl_guarantee_change_statistic", "the change detector's statistic of a stated "
                                      "guarantee for one option count (ibedl.engine.change_detector: an alarm at "
                                      "ibedl_guarantee_change_threshold)", [*g, "options"], registry=r)
        self.guarantee_change_threshold = Gauge("ibedl_guarantee_change_threshold", "the change detectors' alarm "
                                                "threshold", [*g, "options"], registry=r)
        self.promises_suspended = Gauge("ibedl_promises_suspended", "1 while labelled feedback has the promises of a "
                                        "served adapter version suspended (answers say holds: false, "
                                        "violated_by_feedback)", ["adapter", "version"], registry=r)
        self.ready = Gauge("ibedl_ready", "1 when the model is loaded and the service accepts requests", registry=r)
        self.model_info = Info("ibedl_model", "a served adapter", ["adapter"], registry=r)
        self.backend_switches = Counter("ibedl_backend_switches", "switches of an adapter's inference backend to one "
                                        "proven faster in the background (IBEDL_BACKEND=auto)",
                                        ["adapter", "from", "to"], registry=r)

    def request_done(self, route: str, method: str, status: int | str, seconds: float, timed: bool = True) -> None:
        """One request answered (HTTP or gRPC): out of the in-flight gauge, counted by route, method and status,
        its latency observed unless not ``timed`` (refused before its route ran: a burst of quick 401s would pull the
        route's p99 down and hide its queueing)."""
        self.inflight.dec()
        self.requests.labels(route=route, method=method, status=str(status)).inc()
        if timed:
            self.latency.labels(route=route).observe(seconds)

    def set_drift(self, adapter: str, status: dict) -> None:
        nan = float("nan")
        self.drift_ks.labels(adapter=adapter).set(status["ks"] if status["ks"] is not None else nan)
        self.drift_psi.labels(adapter=adapter).set(status["psi"] if status["psi"] is not None else nan)
        self.drift_threshold.labels(adapter=adapter).set(
            status["ks_threshold"] if status["ks_threshold"] is not None else nan)
        self.drift_alarm.labels(adapter=adapter).set(1.0 if status["alarm"] else 0.0)
        self.drift_window.labels(adapter=adapter).set(status["window"])
        self.drift_window_mean.labels(adapter=adapter).set(
            status["window_mean"] if status["window_mean"] is not None else nan)
        self.drift_reference_mean.labels(adapter=adapter).set(
            status["reference_mean"] if status["reference_mean"] is not None else nan)

    def set_accuracy(self, adapter: str, status: dict) -> None:
        nan = float("nan")
        interval = status["estimated_accuracy_interval"] or (nan, nan)
        self.accuracy_estimate.labels(adapter=adapter).set(
            status["estimated_accuracy"] if status["estimated_accuracy"] is not None else nan)
        self.accuracy_lower.labels(adapter=adapter).set(interval[0])
        self.accuracy_upper.labels(adapter=adapter).set(interval[1])
        self.accuracy_window.labels(adapter=adapter).set(status["answered_in_window"])
        self.target_accuracy.labels(adapter=adapter).set(
            status["target_accuracy"] if status["target_accuracy"] is not None else nan)

    def set_guarantees(self, guarantees: list[dict]) -> None:
        """The gauges of every realised guarantee of a served version (``ibedl.engine.feedback.Feedback.guarantees``);
        a retired version's series are removed (its guarantees stay on GET /v1/guarantees)."""
        gauges = (self.guarantee_labels, self.guarantee_hits, self.guarantee_lower, self.guarantee_upper,
                  self.guarantee_stated)
        for g in guarantees:
            labels = {"adapter": g["adapter"], "version": g["version"], "guarantee": g["guarantee"],
                      "stated": "" if g["stated"] is None else f"{g['stated']:g}"}
            if g["retired"]:
                for gauge in gauges:
                    gauge.remove(*(labels[name] for name in GUARANTEE_LABELS))
                for c in g.get("change") or []:
                    for gauge in (self.guarantee_change, self.guarantee_change_threshold):
                        gauge.remove(*(labels[name] for name in GUARANTEE_LABELS), str(c["options"]))
                with contextlib.suppress(KeyError):
                    self.promises_suspended.remove(g["adapter"], g["version"])
                continue
            for c in g.get("change") or []:
                self.guarantee_change.labels(**labels, options=str(c["options"])).set(c["statistic"])
                self.guarantee_change_threshold.labels(**labels, options=str(c["options"])).set(c["threshold"])
            self.promises_suspended.labels(adapter=g["adapter"], version=g["version"]).set(
                1.0 if g.get("suspended") else 0.0)
            self.guarantee_labels.labels(**labels).set(g["labels"])
            self.guarantee_hits.labels(**labels).set(g["hits"])
            self.guarantee_lower.labels(**labels).set(g["lower"])
            self.guarantee_upper.labels(**labels).set(g["upper"])
            self.guarantee_stated.labels(**labels).set(float("nan") if g["stated"] is None else g["stated"])
