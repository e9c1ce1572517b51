"""The feedback store on an SQL database, written once for SQLite (``ibedl.engine.feedback_sqlite``) and PostgreSQL
(``ibedl.engine.feedback_postgres``): the statements, with ``?`` parameters, and the transactions around them. A
database gives its connection, how a transaction begins (a writing one takes the store's one write lock) and which of
its errors mean that it did not answer in time. The tables: ``feedback`` (a label per row, ``seq`` its commit
order), ``feedback_state`` (each series' state as of the label it was last written at) and ``feedback_checkpoint``
(one row: the label the states are complete through)."""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import math
import threading

from ibedl.engine.errors import StoreUnavailable
from ibedl.engine.feedback_store import COLUMNS, REPLAYED, Checkpoint, FeedbackStore, Series

log = logging.getLogger("ibedl.engine.feedback_store")

INSERT = f"INSERT INTO feedback ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
PRUNE_BATCH = 10_000  # raw labels deleted per checkpoint at most: each transaction stays well inside the timeout


class SqlStore(FeedbackStore):
    """A :class:`FeedbackStore` on one database connection behind a lock (thread-safe).

    Args:
        where: the store as messages name it (a path; a DSN without its password).
        timeout_s: the longest wait for a lock or an answer, > 0.
    """

    failures: tuple[type[Exception], ...] = ()  # the database's errors that mean the store did not answer in time

    def __init__(self, where: str, timeout_s: float) -> None:
        super().__init__(where, timeout_s)
        self._lock = threading.Lock()

    # -- what a database gives ------------------------------------------------------------------

    @abc.abstractmethod
    def _execute(self, sql: str, params=()):
        """Run one statement on the connection; a cursor over its rows."""

    @abc.abstractmethod
    def _executemany(self, sql: str, rows: list) -> None:
        ...

    @abc.abstractmethod
    def _begin(self, write: bool) -> None:
        """Start a transaction: a writing one holds the store's one write lock until it ends; a reading one sees
        one consistent state of the store."""

    def _rollback(self) -> None:
        with contextlib.suppress(Exception):  # a lost connection has nothing to roll back
            self._execute("ROLLBACK")

    def _detail(self, error: Exception) -> str:
        """What a database error says, without secrets."""
        return str(error).strip()

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
            except self.failures as e:  # where and why in the log alone: a client learns neither
                log.warning("the feedback store (%s %s) did not answer within %g s: %s", self.setting, self.where,
                            self.timeout_s, self._detail(e))
                raise StoreUnavailable(f"the feedback store ({self.setting}) did not answer within "
                                       f"{self.timeout_s:g} s; retry shortly",
                                       retry_after=max(1, math.ceil(self.timeout_s))) from None

    def _writing(self):
        return self._transaction(write=True)

    # -- labels ---------------------------------------------------------------------------------

    def _labels_of(self, receipt_ids: list[str]) -> dict[str, int]:
        found = {}
        for rid in receipt_ids:
            row = self._execute("SELECT label FROM feedback WHERE receipt_id = ?", (rid,)).fetchone()
            if row is not None:
                found[rid] = row[0]
        return found

    def _insert(self, rows: list[dict]) -> None:
        self._executemany(INSERT, [[row[c] for c in COLUMNS] for row in rows])

    def _count_recorded(self, credential: str, since: float) -> int:
        (count,) = self._execute("SELECT COUNT(*) FROM feedback WHERE credential = ? AND recorded > ?",
                                 (credential, since)).fetchone()
        return count

    def _recorded_at(self, credential: str, since: float, rank: int) -> float:
        (recorded,) = self._execute("SELECT recorded FROM feedback WHERE credential = ? AND recorded > ? ORDER BY "
                                    "recorded LIMIT 1 OFFSET ?", (credential, since, rank)).fetchone()
        return recorded

    def since(self, seq: int) -> list[dict]:
        with self._transaction(write=False):
            return self._rows(f"SELECT seq, {', '.join(COLUMNS)} FROM feedback WHERE seq > ? ORDER BY seq", (seq,))

    def labelled(self, adapter: str, version: str, from_seq: int = 0) -> list[dict]:
        with self._transaction(write=False):
            return self._rows(f"SELECT seq, {', '.join(COLUMNS)} FROM feedback WHERE adapter = ? AND version = ? "
                              "AND seq >= ? ORDER BY seq", (adapter, version, from_seq))

    def _rows(self, sql: str, params) -> list[dict]:
        cursor = self._execute(sql, params)
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    # -- checkpoint -----------------------------------------------------------------------------

    def state(self, series: Series) -> bytes | None:
        with self._transaction(write=False):
            row = self._execute("SELECT state FROM feedback_state WHERE series = ?",
                                (json.dumps(list(series)),)).fetchone()
        return None if row is None else bytes(row[0])

    def _read(self, after: int, limit: int) -> Checkpoint:
        with self._transaction(write=False):
            (checkpoint,) = self._execute("SELECT seq FROM feedback_checkpoint WHERE id = 1").fetchone()
            states = {}
            if checkpoint > after:
                for series, state in self._execute("SELECT series, state FROM feedback_state WHERE seq > ?",
                                                   (after,)).fetchall():
                    states[tuple(json.loads(series))] = bytes(state)
            rows = self._rows(f"SELECT {', '.join(REPLAYED)} FROM feedback WHERE seq > ? ORDER BY seq LIMIT ?",
                              (max(after, checkpoint), limit))
        return Checkpoint(checkpoint, states, rows)

    def save(self, seq: int, states: dict, prune_before: float | None = None) -> bool:
        """:meth:`FeedbackStore.save`; it deletes up to :data:`PRUNE_BATCH` raw labels per call."""
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
