"""The feedback loop of the engine, shared by the HTTP service and the Python API: answers carry a signed receipt
(``ibedl.engine.receipts``); a label sent back with it is checked and kept once in a feedback store; the realised
guarantees of each adapter version (answered accuracy, set coverage, answered share) are measured from the store
with confidence sequences (``ibedl.engine.confidence_sequence``) that stay valid while they are watched; the
adaptive sets (``ibedl.engine.adaptive``, off by default) follow the same labels.

The store is one SQLite file that every replica opens (``IBEDL_FEEDBACK_DB``): a label counts once whichever
replica receives it (the receipt id is the table's key) and every replica reads the same labels in the same order,
so every replica reports the same bounds and adaptive thresholds. Without the setting the store lives in memory,
per process (one replica, tests, notebooks). A receipt keeps its first label: the same label again is a duplicate,
another one is refused (``LabelConflict``). Labels sent over HTTP are counted per credential in the store, so a
credential's cap per time window (``LabelQuota``) holds across replicas.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pydantic import Field

from ibedl.core.conformal import prediction_set
from ibedl.core.prompt import LETTERS
from ibedl.engine import schemas
from ibedl.engine.adaptive import QuantileTracker
from ibedl.engine.confidence_sequence import BettingCS
from ibedl.engine.errors import (AdapterNotServed, FeedbackDisabled, InvalidRequest, LabelConflict, TooLarge,
                                 TooManyLabels)
from ibedl.engine.receipts import Receipt, new_id, sign, verify
from ibedl.engine.runtime import AdapterRuntime
from ibedl.engine.settings import EngineSettings

GUARANTEES = ("answered_accuracy", "set_coverage", "answered_share", "adaptive_set_coverage")

SCHEMA = """
CREATE TABLE IF NOT EXISTS feedback (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    receipt_id TEXT NOT NULL UNIQUE,
    question TEXT NOT NULL,
    adapter TEXT NOT NULL,
    version TEXT NOT NULL,
    options INTEGER NOT NULL,
    label INTEGER NOT NULL,
    predicted INTEGER NOT NULL,
    answered INTEGER NOT NULL,
    target REAL,
    covered INTEGER,
    coverage REAL,
    adaptive_covered INTEGER,
    adaptive_coverage REAL,
    probs TEXT NOT NULL,
    alpha TEXT,
    issued REAL NOT NULL,
    recorded REAL NOT NULL,
    credential TEXT
)
"""
# what a credential's quota counts: its labels recorded since a time
INDEX = "CREATE INDEX IF NOT EXISTS feedback_by_credential ON feedback (credential, recorded)"
COLUMNS = ("receipt_id", "question", "adapter", "version", "options", "label", "predicted", "answered", "target",
           "covered", "coverage", "adaptive_covered", "adaptive_coverage", "probs", "alpha", "issued", "recorded",
           "credential")
ADDED = {"credential": "TEXT"}  # columns added since the first store: a store without them gains them at open


@dataclass(frozen=True)
class LabelQuota:
    """At most ``labels`` new labels per ``window_s`` seconds from one ``credential`` (its name in the store), every
    replica's together: the store counts them."""

    credential: str
    labels: int
    window_s: float

    def __post_init__(self) -> None:
        if self.labels < 1:
            raise ValueError(f"labels must be >= 1, got {self.labels}")
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")


class Guarantee(schemas.Guarantee):
    """One realised guarantee as ``GET /v1/guarantees`` reports it."""

    retired: bool = Field(..., description="this replica does not serve this version (a newer one replaced it; "
                          "during a rollout, also the other replicas' version): its labels stay readable here, but "
                          "this replica exports no ibedl_guarantee_* gauges for it, so it never alerts from here")


class GuaranteesResponse(schemas.GuaranteesResponse):
    guarantees: list[Guarantee]


def served_versions(runtimes: dict[str, AdapterRuntime]) -> dict[str, str]:
    """The version of each served adapter, by name: what a receipt must name to count."""
    return {name: rt.ref["version"] for name, rt in runtimes.items()}


class FeedbackStore:
    """Labelled answers, each once (by receipt id), in the order they were recorded. Thread-safe; several
    processes may share one file (SQLite's lock serialises writers; ``seq`` grows in commit order).

    Args:
        path: the SQLite file (created with its directory); None keeps the store in memory.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(":memory:" if path is None else str(path), timeout=30.0,
                                       isolation_level=None, check_same_thread=False)
            self._db.execute(SCHEMA)
            found = self._columns()
            missing = [c for c in COLUMNS if c not in found]
            if missing and set(missing) <= set(ADDED):  # a store of an earlier version: its labels are kept
                for column in missing:
                    try:
                        self._db.execute(f"ALTER TABLE feedback ADD COLUMN {column} {ADDED[column]}")
                    except sqlite3.OperationalError:  # another replica added it first
                        pass
                found = self._columns()
                missing = [c for c in COLUMNS if c not in found]
            if not missing:
                self._db.execute(INDEX)
        except sqlite3.Error as e:
            raise ValueError(f"cannot use the feedback store {path} (IBEDL_FEEDBACK_DB): {e}") from None
        self._lock = threading.Lock()
        if missing:
            self._db.close()
            raise ValueError(f"the feedback store {path} was written by another version of ibedl (no columns "
                             f"{missing}): point IBEDL_FEEDBACK_DB at a new file")

    def _columns(self) -> set[str]:
        return {row[1] for row in self._db.execute("PRAGMA table_info(feedback)")}

    def add(self, rows: list[dict], quota: LabelQuota | None = None) -> list[str]:
        """Record ``rows`` (dicts of :data:`COLUMNS`) in one transaction. Per row: ``recorded``; ``duplicate``, its
        receipt was recorded before (here or by another replica, or earlier in ``rows``) with the same label; or
        ``conflict``, with another label. Nothing is written when any row conflicts.

        Raises:
            TooManyLabels: the rows would take ``quota.credential`` over its quota (nothing is written).
            TooLarge: ``rows`` hold more new labels than the quota allows in a whole window.
        """
        columns = ", ".join(COLUMNS)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")  # the write lock, held from the check to the insert
            try:
                statuses, seen = [], {}
                for row in rows:
                    rid = row["receipt_id"]
                    if rid not in seen:
                        found = self._db.execute("SELECT label FROM feedback WHERE receipt_id = ?", (rid,)).fetchone()
                        if found is not None:
                            seen[rid] = found[0]
                    if rid in seen:
                        statuses.append("duplicate" if seen[rid] == row["label"] else "conflict")
                    else:
                        statuses.append("recorded")
                        seen[rid] = row["label"]
                fresh = [row for row, status in zip(rows, statuses, strict=True) if status == "recorded"]
                if "conflict" not in statuses:
                    if quota is not None and fresh:
                        self._check_quota(quota, len(fresh), rows[0]["recorded"])
                    self._db.executemany(f"INSERT INTO feedback ({columns}) VALUES ({', '.join('?' * len(COLUMNS))})",
                                         [[row[c] for c in COLUMNS] for row in fresh])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return statuses

    def _check_quota(self, quota: LabelQuota, new: int, now: float) -> None:
        """Raise unless ``quota.credential`` may record ``new`` more labels at ``now`` (inside the transaction)."""
        if new > quota.labels:
            raise TooLarge(f"{new} new labels in one request; the labelling credential may record {quota.labels} "
                           f"per {quota.window_s:g} s (IBEDL_MAX_LABELS): send them in smaller batches", "items")
        since = now - quota.window_s
        (count,) = self._db.execute("SELECT COUNT(*) FROM feedback WHERE credential = ? AND recorded > ?",
                                    (quota.credential, since)).fetchone()
        if count + new <= quota.labels:
            return
        # the labels recorded in the window drop out oldest first: wait until enough of them have
        (oldest,) = self._db.execute("SELECT recorded FROM feedback WHERE credential = ? AND recorded > ? ORDER BY "
                                     "recorded LIMIT 1 OFFSET ?", (quota.credential, since,
                                                                   count + new - quota.labels - 1)).fetchone()
        wait = max(1, math.ceil(oldest + quota.window_s - now))
        raise TooManyLabels(f"this labelling credential recorded {count} labels in the last {quota.window_s:g} s; "
                            f"it may record {quota.labels} per window (IBEDL_MAX_LABELS per IBEDL_LABEL_WINDOW_S): "
                            f"retry after {wait} s", retry_after=wait)

    def since(self, seq: int) -> list[dict]:
        """The rows recorded after ``seq``, in order, each with its ``seq``."""
        with self._lock:
            cursor = self._db.execute(f"SELECT seq, {', '.join(COLUMNS)} FROM feedback WHERE seq > ? ORDER BY seq",
                                      (seq,))
            names = [d[0] for d in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def labelled(self, adapter: str, version: str) -> list[dict]:
        """Every row of one adapter version, in order."""
        with self._lock:
            cursor = self._db.execute(f"SELECT seq, {', '.join(COLUMNS)} FROM feedback WHERE adapter = ? AND "
                                      "version = ? ORDER BY seq", (adapter, version))
            names = [d[0] for d in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def close(self) -> None:
        with self._lock:
            self._db.close()


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
        settings: ``feedback_key`` (None: feedback off), ``feedback_db``, ``feedback_ttl_s``, ``guarantee_alpha``,
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
        self.db = settings.feedback_db
        self.store: FeedbackStore | None = None  # opened by bind()
        self.shared = settings.feedback_db is not None
        self._tracked: dict[tuple, Tracked] = {}
        self._trackers: dict[tuple[str, str], QuantileTracker] = {}
        self._seq = 0
        self._lock = threading.Lock()

    def bind(self, runtimes: dict[str, AdapterRuntime]) -> None:
        """Start the adaptive thresholds of the served adapters (from their calibrated quantiles) and read the
        labels already in the store: a replica that starts later reaches the same thresholds and bounds. Opens the
        store (ValueError when it cannot be used)."""
        if self._key is not None and self.store is None:
            self.store = FeedbackStore(self.db)
        if self.adaptive and self._key is not None:
            for rt in runtimes.values():
                if rt.conformal is not None:
                    c = rt.conformal
                    self._trackers[(rt.name, rt.ref["version"])] = QuantileTracker(
                        min(c.quantile(), 1.0), c.alpha, self.adaptive_rate)
        self.refresh()

    @property
    def enabled(self) -> bool:
        return self._key is not None

    # -- answers ----------------------------------------------------------------------------------

    def adaptive_set(self, runtime: AdapterRuntime, probs) -> list[int] | None:
        """The adaptive set of a question (option indices, most probable first), or None when adaptive sets are
        off or the adapter has no conformal calibration to start from. Answering never reads the store (it must
        not wait on another replica's write): the threshold moves when labels are read, on every label this
        replica records and every ``guarantees`` call (each Prometheus scrape)."""
        tracker = self._tracker(runtime)
        if tracker is None:
            return None
        return prediction_set(probs, tracker.quantile, runtime.conformal.score)

    def receipt(self, runtime: AdapterRuntime, question: str, pred, answered: bool, pset: list[int] | None,
                coverage: float | None, adaptive_set: list[int] | None) -> str | None:
        """The signed receipt of one answer (``pred``: its ``ibedl.core.predictor.Prediction``); None when feedback
        is off."""
        if self._key is None:
            return None
        now = int(self.clock())
        target = runtime.thresholds.how.get("target_accuracy")
        tracker = self._tracker(runtime)
        return sign(Receipt(
            id=new_id(), question=question, adapter=runtime.name, version=runtime.ref["version"],
            options=len(pred.probs), predicted=pred.index, answered=answered,
            set=None if pset is None else tuple(pset), coverage=coverage,
            adaptive_set=None if adaptive_set is None else tuple(adaptive_set),
            adaptive_coverage=None if adaptive_set is None or tracker is None else round(1.0 - tracker.alpha, 6),
            target=None if target is None else float(target), probs=_rounded(pred.probs), alpha=_rounded(pred.alpha),
            issued=now, expires=now + self.ttl_s), self._key)

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
                "credential": None if quota is None else quota.credential,
            })
        statuses = self.store.add(rows, quota)
        conflicts = [i for i, status in enumerate(statuses) if status == "conflict"]
        if conflicts:
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
        """Read the labels recorded since the last refresh (by any replica), in store order, into the guarantees'
        sequences and the adaptive thresholds."""
        if self.store is None:
            return
        with self._lock:
            rows = self.store.since(self._seq)
            for row in rows:
                a, v = row["adapter"], row["version"]
                self._observe(a, v, "answered_share", None, row["answered"])
                if row["answered"] and row["target"] is not None:
                    self._observe(a, v, "answered_accuracy", row["target"], row["label"] == row["predicted"])
                if row["covered"] is not None:
                    self._observe(a, v, "set_coverage", row["coverage"], row["covered"])
                if row["adaptive_covered"] is not None:
                    self._observe(a, v, "adaptive_set_coverage", row["adaptive_coverage"], row["adaptive_covered"])
                    tracker = self._trackers.get((a, v))
                    if tracker is not None:
                        tracker.update(bool(row["adaptive_covered"]))
                self._seq = row["seq"]

    def _observe(self, adapter: str, version: str, guarantee: str, stated: float | None, outcome) -> None:
        key = (adapter, version, guarantee, stated)
        if key not in self._tracked:
            self._tracked[key] = Tracked(adapter, version, guarantee, stated, BettingCS(self.alpha))
        self._tracked[key].cs.update(float(outcome))

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
                out.append({
                    "adapter": t.adapter, "version": t.version, "served": now_served, "retired": not now_served,
                    "guarantee": t.guarantee, "stated": t.stated, "labels": labels, "hits": int(round(t.cs.total)),
                    "estimate": float(t.cs.mean()) if labels else None, "lower": round(float(lower), 6),
                    "upper": round(float(upper), 6),
                    "violated": bool(t.stated is not None and upper < t.stated),
                })
        order = {g: i for i, g in enumerate(GUARANTEES)}
        return sorted(out, key=lambda g: (g["adapter"], g["version"], order[g["guarantee"]], g["stated"] or 0.0))

    def _tracker(self, runtime: AdapterRuntime) -> QuantileTracker | None:
        """The adaptive threshold of ``runtime``'s version; None when adaptive sets are off or it has no
        conformal calibration."""
        return self._trackers.get((runtime.name, runtime.ref["version"]))


def _rounded(values) -> tuple[float, ...] | None:
    return None if values is None else tuple(round(float(v), 6) for v in values)
