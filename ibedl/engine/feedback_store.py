"""Where labelled feedback is kept, behind one small interface (:class:`FeedbackStore`) with two implementations:
SQLite (``ibedl.engine.feedback_sqlite``, ``IBEDL_FEEDBACK_DB``: one file in WAL mode, the zero-setup store of the
replicas of one host; in memory without a file) and PostgreSQL (``ibedl.engine.feedback_postgres``,
``IBEDL_FEEDBACK_DSN``: replicas on several nodes).

A store holds the labels, each once (its receipt id is unique) and in commit order (``seq``: writers take one lock,
so a reader that has seen a label has seen every label before it), and a checkpoint: the state of every realised
guarantee's confidence sequence as of one label (``seq``). A replica starts from the checkpoint and replays only the
labels after it, so its start does not grow with the labels stored; whichever replica has folded labels past the
checkpoint moves it (every replica folds the same labels in the same order, so any of them may). Raw labels older
than the retention are deleted once the checkpoint holds them: the guarantees keep counting them.
"""

from __future__ import annotations

import abc
import contextlib
import json
import math
import threading
from dataclasses import dataclass

from ibedl.engine.errors import StoreUnavailable, TooLarge, TooManyLabels

# one label: what its receipt said and what was sent back, when, by which credential
COLUMNS = ("receipt_id", "question", "adapter", "version", "options", "label", "predicted", "answered", "target",
           "covered", "coverage", "adaptive_covered", "adaptive_coverage", "probs", "alpha", "issued", "recorded",
           "credential", "calibration")
# what a replica folds into the guarantees and the adaptive thresholds (not the question, outputs or credential)
REPLAYED = ("seq", "adapter", "version", "options", "answered", "target", "label", "predicted", "covered", "coverage",
            "adaptive_covered", "adaptive_coverage", "recorded")
INSERT = f"INSERT INTO feedback ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
PRUNE_BATCH = 10_000  # raw labels deleted per checkpoint at most: each transaction stays well inside the timeout

# a key of the checkpoint's states: (adapter, version, guarantee, stated) a realised guarantee's confidence sequence;
# (adapter, version, guarantee, stated, options) its change detector for one option count; (adapter, version,
# "suspended") the record of a version whose promises labelled feedback suspended (ibedl.engine.feedback)
Series = tuple


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


@dataclass(frozen=True)
class Snapshot:
    """What a replica at label ``after`` reads to catch up, from one consistent view of the store.

    Attributes:
        checkpoint: the label through which the store's states are folded (0: none yet).
        states: the states (``BettingCS.state``) of the series the checkpoint moved since ``after``; empty when the
            checkpoint is not past ``after``.
        rows: the labels after ``max(after, checkpoint)``, in order, with the :data:`REPLAYED` columns.
    """

    checkpoint: int
    states: dict
    rows: list[dict]


class FeedbackStore(abc.ABC):
    """Labels once by receipt id, in commit order, and the checkpoint of the guarantees' states. Thread-safe (one
    connection behind a lock); several processes and hosts may share one store. Every call waits at most about
    ``timeout_s`` for the store (another writer's lock, a slow server), then raises ``StoreUnavailable``.

    The SQL is written once here, with ``?`` parameters; a backend gives the connection and its transactions.

    Args:
        where: the store as messages name it (a path; a DSN without its password).
        timeout_s: the longest wait for a lock or an answer, > 0.
    """

    setting = ""  # the setting that names this kind of store, for messages
    failures: tuple[type[Exception], ...] = ()  # the backend's errors that mean the store did not answer in time

    def __init__(self, where: str, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.where, self.timeout_s = where, float(timeout_s)
        self._lock = threading.Lock()

    # -- what a backend gives -------------------------------------------------------------------

    @abc.abstractmethod
    def _execute(self, sql: str, params=()):
        """Run one statement on the connection; a cursor over its rows."""
        ...

    @abc.abstractmethod
    def _executemany(self, sql: str, rows: list) -> None:
        ...

    @abc.abstractmethod
    def _begin(self, write: bool) -> None:
        """Start a transaction: a writing one holds the store's one write lock until it ends; a reading one sees
        one consistent state of the store."""
        ...

    def _rollback(self) -> None:
        with contextlib.suppress(Exception):  # a lost connection has nothing to roll back
            self._execute("ROLLBACK")

    def _detail(self, error: Exception) -> str:
        """What a backend error says, without secrets."""
        return str(error).strip()

    @abc.abstractmethod
    def close(self) -> None:
        ...

    # -- transactions ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self, write: bool):
        with self._lock:
            try:
                try:
                    self._begin(write)
                    yield
                    self._execute("COMMIT")
                except BaseException:  # a lock wait that timed out too: its transaction is open, and failed
                    self._rollback()
                    raise
            except self.failures as e:
                raise StoreUnavailable(f"the feedback store ({self.setting} {self.where}) did not answer within "
                                       f"{self.timeout_s:g} s: {self._detail(e)}; retry shortly",
                                       retry_after=max(1, math.ceil(self.timeout_s))) from None

    # -- labels ---------------------------------------------------------------------------------

    def add(self, rows: list[dict], quota: LabelQuota | None = None) -> list[str]:
        """Record ``rows`` (dicts of :data:`COLUMNS`) in one transaction. Per row: ``recorded``; ``duplicate``, its
        receipt was recorded before (here or by another replica, or earlier in ``rows``) with the same label; or
        ``conflict``, with another label. Nothing is written when any row conflicts.

        Raises:
            TooManyLabels: the rows would take ``quota.credential`` over its quota (nothing is written).
            TooLarge: ``rows`` hold more new labels than the quota allows in a whole window.
            StoreUnavailable: the store did not answer in time (nothing is written).
        """
        with self._transaction(write=True):  # the write lock, held from the check to the insert
            statuses, seen = [], {}
            for row in rows:
                rid = row["receipt_id"]
                if rid not in seen:
                    found = self._execute("SELECT label FROM feedback WHERE receipt_id = ?", (rid,)).fetchone()
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
                if fresh:
                    self._executemany(INSERT, [[row[c] for c in COLUMNS] for row in fresh])
        return statuses

    def _check_quota(self, quota: LabelQuota, new: int, now: float) -> None:
        """Raise unless ``quota.credential`` may record ``new`` more labels at ``now`` (inside the transaction)."""
        if new > quota.labels:
            raise TooLarge(f"{new} new labels in one request; the labelling credential may record {quota.labels} "
                           f"per {quota.window_s:g} s (IBEDL_MAX_LABELS): send them in smaller batches", "items")
        since = now - quota.window_s
        (count,) = self._execute("SELECT COUNT(*) FROM feedback WHERE credential = ? AND recorded > ?",
                                 (quota.credential, since)).fetchone()
        if count + new <= quota.labels:
            return
        # the labels recorded in the window drop out oldest first: wait until enough of them have
        (oldest,) = self._execute("SELECT recorded FROM feedback WHERE credential = ? AND recorded > ? ORDER BY "
                                  "recorded LIMIT 1 OFFSET ?", (quota.credential, since,
                                                                count + new - quota.labels - 1)).fetchone()
        wait = max(1, math.ceil(oldest + quota.window_s - now))
        raise TooManyLabels(f"this labelling credential recorded {count} labels in the last {quota.window_s:g} s; "
                            f"it may record {quota.labels} per window (IBEDL_MAX_LABELS per IBEDL_LABEL_WINDOW_S): "
                            f"retry after {wait} s", retry_after=wait)

    def since(self, seq: int) -> list[dict]:
        """The stored labels recorded after ``seq``, in order, each with its ``seq`` (labels past the retention are
        gone: the checkpoint counts them)."""
        with self._transaction(write=False):
            return self._rows(f"SELECT seq, {', '.join(COLUMNS)} FROM feedback WHERE seq > ? ORDER BY seq", (seq,))

    def labelled(self, adapter: str, version: str, from_seq: int = 0) -> list[dict]:
        """Every stored label of one adapter version from sequence number ``from_seq`` on, in order (what a
        recalibration on the traffic reads)."""
        with self._transaction(write=False):
            return self._rows(f"SELECT seq, {', '.join(COLUMNS)} FROM feedback WHERE adapter = ? AND version = ? "
                              "AND seq >= ? ORDER BY seq", (adapter, version, from_seq))

    def state(self, series: Series) -> bytes | None:
        """The checkpoint's state of one series (None: none saved)."""
        with self._transaction(write=False):
            row = self._execute("SELECT state FROM feedback_state WHERE series = ?",
                                (json.dumps(list(series)),)).fetchone()
        return None if row is None else bytes(row[0])

    def _rows(self, sql: str, params) -> list[dict]:
        cursor = self._execute(sql, params)
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    # -- checkpoint -----------------------------------------------------------------------------

    def read(self, after: int, limit: int) -> Snapshot:
        """What a replica that has folded the labels through ``after`` needs to catch up: the states the
        checkpoint moved since (when it is past ``after``), then at most ``limit`` labels after both."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        with self._transaction(write=False):
            (checkpoint,) = self._execute("SELECT seq FROM feedback_checkpoint WHERE id = 1").fetchone()
            states = {}
            if checkpoint > after:
                for series, state in self._execute("SELECT series, state FROM feedback_state WHERE seq > ?",
                                                   (after,)).fetchall():
                    states[tuple(json.loads(series))] = bytes(state)
            rows = self._rows(f"SELECT {', '.join(REPLAYED)} FROM feedback WHERE seq > ? ORDER BY seq LIMIT ?",
                              (max(after, checkpoint), limit))
        return Snapshot(checkpoint, states, rows)

    def save(self, seq: int, states: dict, prune_before: float | None = None) -> bool:
        """Move the checkpoint to label ``seq``, writing ``states`` (by series: every series that changed since the
        checkpoint this replica last read or wrote), unless the store's checkpoint is already there or past it
        (another replica folded as far: its states are these). Then delete up to :data:`PRUNE_BATCH` raw labels
        recorded before ``prune_before`` (unix seconds; None: keep them) that the checkpoint holds. Whether the
        checkpoint moved."""
        with self._transaction(write=True):
            (stored,) = self._execute("SELECT seq FROM feedback_checkpoint WHERE id = 1").fetchone()
            if stored >= seq:
                return False
            self._executemany("INSERT INTO feedback_state (series, seq, state) VALUES (?, ?, ?) ON CONFLICT (series) "
                              "DO UPDATE SET seq = excluded.seq, state = excluded.state",
                              [(json.dumps(list(series)), seq, state) for series, state in states.items()])
            self._execute("UPDATE feedback_checkpoint SET seq = ? WHERE id = 1", (seq,))
            if prune_before is not None:
                self._execute("DELETE FROM feedback WHERE seq IN (SELECT seq FROM feedback WHERE recorded < ? AND "
                              "seq <= ? ORDER BY seq LIMIT ?)", (prune_before, seq, PRUNE_BATCH))
        return True
