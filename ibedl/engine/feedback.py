"""The feedback loop of the engine, shared by the HTTP service and the Python API: answers carry a signed receipt
(``ibedl.engine.receipts``); a label sent back with it is checked and kept once in a feedback store; the realised
guarantees of each adapter version (answered accuracy, set coverage, answered share) are measured from the store
with confidence sequences (``ibedl.engine.confidence_sequence``) that stay valid while they are watched; the
adaptive sets (``ibedl.engine.adaptive``, off by default) follow the same labels.

The store (``ibedl.engine.feedback_store``; the settings choose its kind in ``ibedl.engine.feedback_kinds``) is one
that every replica opens: a SQLite file for the replicas of one host (``IBEDL_FEEDBACK_DB``) or a PostgreSQL database
for several nodes (``IBEDL_FEEDBACK_DSN``). A label counts once whichever replica receives it (the receipt id is
unique) and every replica folds the same labels in the same order, so every replica reports the same bounds and
adaptive thresholds. A replica starts from the store's checkpoint (the sequences' states) and folds only the labels
after it; whichever replica folds past the checkpoint moves it, so a start costs the same at a million labels as at
none. Without a store setting it lives in memory, per process (one replica, tests, notebooks). A receipt keeps its
first label: the same label again is a duplicate, another one is refused (``LabelConflict``). Labels sent over HTTP
are counted per credential in the store, so a credential's cap per time window (``LabelQuota``) holds across
replicas.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from ibedl.core.conformal import prediction_set
from ibedl.core.prompt import LETTERS
from ibedl.engine.adaptive import QuantileTracker
from ibedl.engine.change_detector import ChangeDetector, alarm_threshold
from ibedl.engine.confidence_sequence import BettingCS
from ibedl.engine.errors import AdapterNotServed, FeedbackDisabled, InvalidRequest, LabelConflict, StoreUnavailable
from ibedl.engine.feedback_kinds import open_store, persistent
from ibedl.engine.feedback_store import Checkpoint, FeedbackStore, LabelQuota
from ibedl.engine.receipts import Receipt, new_id, sign, verify
from ibedl.engine.runtime import AdapterRuntime
from ibedl.engine.settings import EngineSettings

GUARANTEES = ("answered_accuracy", "set_coverage", "answered_share", "adaptive_set_coverage")
# the stated guarantees a label can test, each with a change detector per option count (the detectors' threshold
# counts them: a label updates at most this many)
WATCHED = ("answered_accuracy", "set_coverage")
SUSPENDED = "suspended"  # the checkpoint key (adapter, version, SUSPENDED) of a version's suspension

REPLAY_PAGE = 10_000  # labels folded per read when a replica catches up: memory and each read stay bounded

log = logging.getLogger("ibedl.engine")


def served_versions(runtimes: dict[str, AdapterRuntime]) -> dict[str, str]:
    """The version of each served adapter, by name: what a receipt must name to count."""
    return {name: rt.ref["version"] for name, rt in runtimes.items()}


@dataclass
class Tracked:
    """One realised guarantee of one adapter version: its stated level (None: none stated) and its sequence."""

    adapter: str
    version: str
    guarantee: str
    stated: float | None
    cs: BettingCS


class Feedback:
    """Receipts out, labels in, realised guarantees and adaptive thresholds from the store.

    Args:
        settings: ``feedback_key`` (None: feedback off), the store (``feedback_db`` or ``feedback_dsn``,
            ``feedback_timeout_s``, ``feedback_retention_days``), ``feedback_ttl_s``, ``guarantee_alpha``,
            ``adaptive_sets``, ``adaptive_rate``.
        clock: unix seconds now (tests inject one).
    """

    def __init__(self, settings: EngineSettings, clock: Callable[[], float] = time.time) -> None:
        key = settings.feedback_key
        self._key = key.get_secret_value().encode("utf-8") if key is not None else None
        self.ttl_s = settings.feedback_ttl_s
        self.alpha = settings.guarantee_alpha
        self.adaptive = settings.adaptive_sets
        self.adaptive_rate = settings.adaptive_rate
        self.clock = clock
        self._settings = settings  # what bind() opens the store from
        self.store: FeedbackStore | None = None  # opened by bind()
        self.shared = persistent(settings)
        self.retention_s = settings.feedback_retention_days * 86400 or None  # None: raw labels kept for ever
        self._tracked: dict[tuple, Tracked] = {}
        self._trackers: dict[tuple[str, str], QuantileTracker] = {}
        # change detectors by (adapter, version, guarantee, stated, options), and the versions whose promises labels
        # suspended: (adapter, version) -> {"since", "guarantee", "stated", "options", "by", "change_seq"}
        self._detectors: dict[tuple, ChangeDetector] = {}
        self._suspended: dict[tuple[str, str], dict] = {}
        self.change_false_alarm, self.change_horizon = settings.change_false_alarm, settings.change_horizon
        self.change_threshold = alarm_threshold(settings.change_horizon, settings.change_false_alarm, len(WATCHED))
        self.conflicts: dict[str, int] = {}  # labels refused for contradicting their receipt's first, by adapter
        self._seq = 0  # the last label folded in
        self._saved: dict[tuple, int] = {}  # labels of each series in the store's checkpoint, as last read or written
        self._lock = threading.Lock()

    def bind(self, runtimes: dict[str, AdapterRuntime]) -> None:
        """Start the adaptive thresholds of the served adapters (from their calibrated quantiles) and read the
        labels already in the store (its checkpoint, then the labels after it): a replica that starts later reaches
        the same thresholds and bounds. Opens the store (ValueError when it cannot be used, StoreUnavailable when it
        does not answer)."""
        if self._key is not None and self.store is None:
            self.store = open_store(self._settings)
        if self.adaptive and self._key is not None:
            for rt in runtimes.values():
                if rt.conformal is not None and (rt.name, rt.ref["version"]) not in self._trackers:  # bind again:
                    c = rt.conformal  # (after a store that did not answer) the thresholds keep what they folded
                    self._trackers[(rt.name, rt.ref["version"])] = QuantileTracker(
                        min(c.quantile(), 1.0), c.alpha, self.adaptive_rate)
        self.refresh()

    @property
    def enabled(self) -> bool:
        return self._key is not None

    # -- answers ----------------------------------------------------------------------------------

    def adaptive_set(self, runtime: AdapterRuntime, probs) -> list[int] | None:
        """The adaptive rule's set of a question (option indices, most probable first; empty when the threshold
        is below every option's score, which its receipt counts as a miss: ibedl.engine.adaptive), or None when
        adaptive sets are off or the adapter has no conformal calibration to start from. Answering never reads the
        store (it must not wait on another replica's write): the threshold moves when labels are read, on every
        label this replica records and every ``guarantees`` call (each Prometheus scrape)."""
        tracker = self._tracker(runtime)
        if tracker is None:
            return None
        return prediction_set(probs, tracker.quantile, runtime.conformal.score, never_empty=False)

    def receipt(self, runtime: AdapterRuntime, question: str, pred, answered: bool, pset: list[int] | None,
                coverage: float | None, adaptive_set: list[int] | None, own_rule: bool = True) -> str | None:
        """The signed receipt of one answer (``pred``: its ``ibedl.core.predictor.Prediction``); None when feedback
        is off. ``own_rule`` False: the request chose its own thresholds, and its label tests no accuracy target."""
        if self._key is None:
            return None
        now = int(self.clock())
        # an option count the calibration never covered carries no stated level, nor a target the calibration could
        # not certify (the answer states none: ibedl.engine.responses.stated_guarantees): their labels test nothing
        counts = runtime.option_counts
        claimed = counts is None or len(pred.probs) in counts
        target = runtime.thresholds.for_options(len(pred.probs)).stated_target if claimed and own_rule else None
        # a marginal set (no delta: calibrations before PAC sets) promises its level over calibration draws, not for
        # this calibration: its labels would find the served rule's own coverage, Beta-spread about it, and suspend
        coverage = coverage if claimed and runtime.conformal is not None and runtime.conformal.delta is not None \
            else None
        tracker = self._tracker(runtime)
        return sign(Receipt(
            id=new_id(), question=question, adapter=runtime.name, version=runtime.ref["version"],
            options=len(pred.probs), predicted=pred.index, answered=answered,
            set=None if pset is None else tuple(pset), coverage=coverage,
            adaptive_set=None if adaptive_set is None else tuple(adaptive_set),
            adaptive_coverage=None if adaptive_set is None or tracker is None else round(1.0 - tracker.alpha, 6),
            target=None if target is None else float(target), probs=_rounded(pred.probs), alpha=_rounded(pred.alpha),
            issued=now, expires=now + self.ttl_s, calibration=runtime.ref["calibration"]), self._key)

    # -- labels -----------------------------------------------------------------------------------

    def record(self, served: dict[str, str], items: list[tuple[str, str]], prefix: str = "",
               quota: LabelQuota | None = None) -> list[dict]:
        """Check every (receipt, label letter) of ``items``, then record them all in one transaction; one bad item
        refuses the lot and nothing is recorded. ``served``: the version of each served adapter, by name
        (:func:`served_versions`). ``quota``: the sending credential's cap (the HTTP service's; None: no cap, as for
        the Python API, whose caller holds the key and the store).

        Returns, per item: ``receipt_id``, ``question``, ``adapter``, ``version``, ``status`` (``recorded``, or
        ``duplicate`` when that receipt was recorded before with the same label), ``correct`` (None when the
        service abstained) and ``covered`` (None without a set).

        Raises:
            FeedbackDisabled: no key configured.
            InvalidReceipt, ReceiptExpired: see ``ibedl.engine.receipts.verify``.
            AdapterNotServed: the receipt's adapter version is not among ``served``.
            InvalidRequest: a label that is not one of the question's options.
            LabelConflict: a receipt recorded before (or earlier in ``items``) with another label.
            TooManyLabels, TooLarge: over ``quota``.
        """
        if self._key is None or self.store is None:
            raise FeedbackDisabled("feedback is off: the service has no receipt key (set IBEDL_FEEDBACK_KEY), so its "
                                   "answers carry no receipt")
        now = self.clock()
        rows, receipts = [], []
        for i, (token, letter) in enumerate(items):
            where = f"{prefix}{i}." if prefix else ""
            receipt = verify(token, self._key, now, where + "receipt")
            if served.get(receipt.adapter) != receipt.version:
                raise AdapterNotServed(f"the receipt is of adapter {receipt.adapter!r} version {receipt.version}, "
                                       f"which is no longer served (served: {served}); its label cannot count for "
                                       "what is served now", where + "receipt")
            letters = LETTERS[: receipt.options]
            if not isinstance(letter, str) or letter not in letters:
                raise InvalidRequest(f"label must be one of the question's options {list(letters)}, got {letter!r}",
                                     where + "label")
            label = letters.index(letter)
            receipts.append(receipt)
            rows.append({
                "receipt_id": receipt.id, "question": receipt.question, "adapter": receipt.adapter,
                "version": receipt.version, "options": receipt.options, "label": label,
                "predicted": receipt.predicted, "answered": int(receipt.answered), "target": receipt.target,
                "covered": None if receipt.set is None else int(label in receipt.set), "coverage": receipt.coverage,
                "adaptive_covered": None if receipt.adaptive_set is None else int(label in receipt.adaptive_set),
                "adaptive_coverage": receipt.adaptive_coverage, "probs": json.dumps(receipt.probs),
                "alpha": None if receipt.alpha is None else json.dumps(receipt.alpha),
                "issued": float(receipt.issued), "recorded": now,
                "credential": None if quota is None else quota.credential, "calibration": receipt.calibration,
            })
        statuses = self.store.add(rows, quota)
        conflicts = [i for i, status in enumerate(statuses) if status == "conflict"]
        if conflicts:
            with self._lock:  # counted whichever door sent them (HTTP, the Python API, the batch command)
                for i in conflicts:
                    self.conflicts[receipts[i].adapter] = self.conflicts.get(receipts[i].adapter, 0) + 1
            first = receipts[conflicts[0]]
            more = f" ({len(conflicts)} of the {len(items)} items conflict; nothing was recorded)" if prefix else ""
            raise LabelConflict(f"receipt {first.id} already has another label: a receipt keeps its first label, and "
                                f"a different one is refused{more}", f"{prefix}{conflicts[0]}.label" if prefix
                                else "label", tuple(receipts[i].adapter for i in conflicts))
        self.refresh()
        return [{"receipt_id": r.id, "question": r.question, "adapter": r.adapter, "version": r.version,
                 "status": status, "correct": bool(row["label"] == r.predicted) if r.answered else None,
                 "covered": None if row["covered"] is None else bool(row["covered"])}
                for r, row, status in zip(receipts, rows, statuses, strict=True)]

    # -- guarantees -------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Bring the guarantees' sequences and the adaptive thresholds up to the store: the states its checkpoint
        moved past this replica (every state, at start), then the labels recorded after both (by any replica), in
        store order, a page at a time; then move the checkpoint to what was folded. StoreUnavailable when the store
        does not answer in time (what was folded stays folded)."""
        if self.store is None:
            return
        with self._lock:
            while True:
                checkpoint = self.store.read(self._seq, REPLAY_PAGE)
                if checkpoint.seq > self._seq:
                    self._restore(checkpoint)
                self._fold(checkpoint.rows)
                self._save(checkpoint.seq)
                if len(checkpoint.rows) < REPLAY_PAGE:
                    return

    def _fold(self, rows: list[dict]) -> None:
        """Labels after the last one folded, in store order, into the sequences, the change detectors and the
        adaptive thresholds; a version whose stated guarantee they show broken is suspended."""
        for row in rows:
            a, v = row["adapter"], row["version"]
            self._observe(a, v, "answered_share", None, row["answered"])
            if row["answered"] and row["target"] is not None:
                self._observe(a, v, "answered_accuracy", row["target"], row["label"] == row["predicted"], row)
            if row["covered"] is not None and row["coverage"] is not None:  # a set of no stated coverage tests none
                self._observe(a, v, "set_coverage", row["coverage"], row["covered"], row)
            if row["adaptive_covered"] is not None:
                self._observe(a, v, "adaptive_set_coverage", row["adaptive_coverage"], row["adaptive_covered"])
                tracker = self._trackers.get((a, v))
                if tracker is not None:
                    tracker.update(bool(row["adaptive_covered"]))
            self._seq = row["seq"]

    def _restore(self, checkpoint: Checkpoint) -> None:
        """Take the store's checkpoint, past this replica's labels: the states of the series it moved (the others
        are as this replica has them), and each adaptive threshold from its version's adaptive set coverage (the
        threshold is a function of the labels and misses it saw)."""
        for key, state in checkpoint.states.items():
            if len(key) == 3 and key[2] == SUSPENDED:
                self._suspended[(key[0], key[1])] = json.loads(state)
            elif len(key) == 5:
                self._detector(*key).restore(state)
            else:
                self._series(*key).cs.restore(state)
        for (adapter, version), tracker in self._trackers.items():
            seen = [t.cs for t in self._tracked.values()
                    if (t.adapter, t.version, t.guarantee) == (adapter, version, "adaptive_set_coverage")]
            labels = sum(int(cs.n) for cs in seen)
            tracker.restore(labels, labels - sum(int(round(float(cs.total))) for cs in seen))
        self._seq = checkpoint.seq
        self._saved = self._counts()

    def _counts(self) -> dict[tuple, int]:
        """What each state in the checkpoint stands at: labels of a sequence or a detector, 1 for a suspension."""
        return {**{key: int(t.cs.n) for key, t in self._tracked.items()},
                **{key: int(d.n) for key, d in self._detectors.items()},
                **{(*version, SUSPENDED): 1 for version in self._suspended}}

    def _states(self, keys) -> dict[tuple, bytes]:
        out = {}
        for key in keys:
            if len(key) == 3:
                out[key] = json.dumps(self._suspended[key[:2]]).encode()
            elif len(key) == 5:
                out[key] = self._detectors[key].state()
            else:
                out[key] = self._tracked[key].cs.state()
        return out

    def _save(self, checkpoint: int) -> None:
        """Move the store's checkpoint (at label ``checkpoint``) to the last label folded here, with the states of
        the series that changed since this replica last read or wrote it, and delete the raw labels past the
        retention that it holds. A store that does not answer keeps its checkpoint: the next refresh tries again."""
        counts = self._counts()
        changed = self._states([key for key, n in counts.items() if n != self._saved.get(key, 0)])
        if self._seq <= checkpoint or not changed:
            return
        try:
            self.store.save(self._seq, changed, None if self.retention_s is None else self.clock() - self.retention_s)
        except StoreUnavailable as e:
            log.warning("the feedback store's checkpoint stays at label %d: %s", checkpoint, e.message)
            return
        # moved, or another replica moved it as far or further: either way the store holds these states
        self._saved.update({key: counts[key] for key in changed})

    def _observe(self, adapter: str, version: str, guarantee: str, stated: float | None, outcome,
                 row: dict | None = None) -> None:
        """One outcome of a realised guarantee; with its label's ``row``, also into the change detector of its
        option count, and a version whose promise the sequence or the detector now shows broken is suspended."""
        tracked = self._series(adapter, version, guarantee, stated)
        tracked.cs.update(float(outcome))
        if row is None or stated is None or not 0.0 < stated < 1.0:
            return
        detector = self._detector(adapter, version, guarantee, stated, int(row["options"]))
        detector.update(float(outcome), mark=row["seq"])
        if (adapter, version) in self._suspended:
            return
        if detector.alarmed():
            by, change = "change_detector", int(detector.change_at)
        elif tracked.cs.bounds()[1] < stated:
            by, change = "confidence_sequence", None
        else:
            return
        since = datetime.fromtimestamp(float(row["recorded"]), timezone.utc).isoformat(timespec="seconds")
        self._suspended[(adapter, version)] = {"since": since, "guarantee": guarantee, "stated": stated,
                                               "options": int(row["options"]), "by": by, "label_seq": int(row["seq"]),
                                               "change_seq": change}
        log.warning("adapter %s version %s: labelled feedback shows its %s (stated %g, %d options) broken (%s); its "
                    "promises are suspended until a recalibrated version replaces it%s", adapter, version, guarantee,
                    stated, int(row["options"]), by,
                    f" (labels from seq {change} on show the change)" if change is not None else "")

    def _detector(self, adapter: str, version: str, guarantee: str, stated: float, options: int) -> ChangeDetector:
        key = (adapter, version, guarantee, stated, options)
        if key not in self._detectors:
            self._detectors[key] = ChangeDetector(stated, self.change_threshold)
        return self._detectors[key]

    def suspension(self, runtime: AdapterRuntime) -> dict | None:
        """Why the promises of ``runtime``'s version are suspended (``since``, the ``guarantee`` shown broken, its
        ``stated`` level and ``options``, ``by`` which test, ``change_seq``: the first label of the change the
        detector estimated), or None while they stand. Answering reads only what this replica folded."""
        return self._suspended.get((runtime.name, runtime.ref["version"]))

    def _series(self, adapter: str, version: str, guarantee: str, stated: float | None) -> Tracked:
        """The realised guarantee of one series, empty the first time it is seen (a label, a checkpoint's state)."""
        key = (adapter, version, guarantee, stated)
        if key not in self._tracked:
            self._tracked[key] = Tracked(adapter, version, guarantee, stated, BettingCS(self.alpha))
        return self._tracked[key]

    def guarantees(self, served: dict[str, str], adapter: str | None = None) -> list[dict]:
        """Every realised guarantee in the store (of ``adapter`` only, when given): ``adapter``, ``version``,
        ``served``, ``retired`` (not served: labelled before a newer version replaced it; kept for the record, never
        alerted on), ``guarantee``, ``stated``, ``labels``, ``hits``, ``estimate``, ``lower``, ``upper``,
        ``violated`` (the upper bound is below the stated level). FeedbackDisabled when feedback is off."""
        if self.store is None:
            raise FeedbackDisabled("feedback is off: no receipt key is configured (IBEDL_FEEDBACK_KEY), so no labels "
                                   "are collected")
        self.refresh()
        out = []
        with self._lock:
            for t in self._tracked.values():
                if adapter is not None and t.adapter != adapter:
                    continue
                lower, upper = t.cs.bounds()
                labels = int(t.cs.n)
                now_served = served.get(t.adapter) == t.version
                broken = bool(t.stated is not None and upper < t.stated)
                change = [{"options": key[4], "labels": int(d.n), "statistic": round(float(d.statistic()), 6),
                           "threshold": d.threshold, "alarm": bool(d.alarmed()),
                           "change_seq": int(d.change_at) if d.alarmed() else None}
                          for key, d in sorted(self._detectors.items(), key=lambda kv: kv[0][4])
                          if key[:4] == (t.adapter, t.version, t.guarantee, t.stated)]
                suspended = self._suspended.get((t.adapter, t.version))
                out.append({
                    "adapter": t.adapter, "version": t.version, "served": now_served, "retired": not now_served,
                    "guarantee": t.guarantee, "stated": t.stated, "labels": labels, "hits": int(round(t.cs.total)),
                    "estimate": float(t.cs.mean()) if labels else None, "lower": round(float(lower), 6),
                    "upper": round(float(upper), 6),
                    # what alerts read: a served version's promise shown broken since it started (the sequence) or
                    # since a change (a detector); a retired version's are kept apart, for the record
                    "violated": now_served and broken,
                    "changed": now_served and any(c["alarm"] for c in change),
                    "violated_before_retired": not now_served and (broken or any(c["alarm"] for c in change)),
                    "change": change,
                    "suspended": None if suspended is None or not now_served else suspended,
                })
        order = {g: i for i, g in enumerate(GUARANTEES)}
        return sorted(out, key=lambda g: (g["adapter"], g["version"], order[g["guarantee"]], g["stated"] or 0.0))

    def _tracker(self, runtime: AdapterRuntime) -> QuantileTracker | None:
        """The adaptive threshold of ``runtime``'s version; None when adaptive sets are off or it has no
        conformal calibration."""
        return self._trackers.get((runtime.name, runtime.ref["version"]))


def _rounded(values) -> tuple[float, ...] | None:
    return None if values is None else tuple(round(float(v), 6) for v in values)
