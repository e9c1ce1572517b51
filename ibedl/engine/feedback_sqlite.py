"""The feedback store in one SQLite file (``IBEDL_FEEDBACK_DB``), the zero-setup default: the replicas of one host
share it (WAL mode: readers never wait for the writer; SQLite's lock serialises writers, so ``seq`` grows in commit
order). WAL needs the file on a local filesystem that every replica maps (one host; a volume shared by the
containers of one host): replicas on several nodes share a PostgreSQL store instead. Without a file the store lives
in memory, per process (one replica, tests, notebooks)."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from ibedl.engine.feedback_sql import SqlStore
from ibedl.engine.feedback_store import COLUMNS

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
    credential TEXT,
    calibration TEXT
)
"""
# what a credential's quota counts (its labels recorded since a time) and what the retention deletes (old labels)
INDEXES = ("CREATE INDEX IF NOT EXISTS feedback_by_credential ON feedback (credential, recorded)",
           "CREATE INDEX IF NOT EXISTS feedback_by_recorded ON feedback (recorded)")
# the checkpoint: each series' state as of the label seq it was last written at, and the label it is complete through
CHECKPOINT = ("CREATE TABLE IF NOT EXISTS feedback_state (series TEXT PRIMARY KEY, seq INTEGER NOT NULL, "
              "state BLOB NOT NULL)",
              "CREATE TABLE IF NOT EXISTS feedback_checkpoint (id INTEGER PRIMARY KEY CHECK (id = 1), "
              "seq INTEGER NOT NULL)",
              "INSERT INTO feedback_checkpoint (id, seq) VALUES (1, 0) ON CONFLICT (id) DO NOTHING")
# columns added since the first store: a store without them gains them at open (its older labels: NULL)
ADDED = {"credential": "TEXT", "calibration": "TEXT"}


class SqliteStore(SqlStore):
    """The feedback store in the SQLite file ``path`` (created with its directory, in WAL mode); None keeps it in
    memory.

    Args:
        path: the SQLite file, or None.
        timeout_s: SQLite's busy timeout: how long a call waits for another connection's write lock.
    """

    setting = "IBEDL_FEEDBACK_DB"
    failures = (sqlite3.OperationalError,)  # "database is locked" past the busy timeout, a failing disk

    def __init__(self, path: Path | None, timeout_s: float = 5.0) -> None:
        super().__init__(":memory:" if path is None else str(path), timeout_s)
        self.path = path
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.where, timeout=self.timeout_s, isolation_level=None,
                                       check_same_thread=False)
            if path is not None:
                self.journal = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if self.journal != "wal":
                    raise sqlite3.OperationalError(f"it cannot run in WAL mode (journal mode {self.journal}): keep "
                                                   "the file on a local filesystem")
            else:
                self.journal = "memory"
            self._db.execute(SCHEMA)
            found = self._columns()
            missing = [c for c in COLUMNS if c not in found]
            if missing and set(missing) <= set(ADDED):  # a store of an earlier version: its labels are kept
                for column in missing:
                    with contextlib.suppress(sqlite3.OperationalError):  # another replica may add it first
                        self._db.execute(f"ALTER TABLE feedback ADD COLUMN {column} {ADDED[column]}")
                found = self._columns()
                missing = [c for c in COLUMNS if c not in found]
            if not missing:
                for statement in INDEXES + CHECKPOINT:
                    self._db.execute(statement)
        except sqlite3.Error as e:
            raise ValueError(f"cannot use the feedback store {path} ({self.setting}): {e}") from None
        if missing:
            self._db.close()
            raise ValueError(f"the feedback store {path} was written by another version of ibedl (no columns "
                             f"{missing}): point {self.setting} at a new file")

    def _columns(self) -> set[str]:
        return {row[1] for row in self._db.execute("PRAGMA table_info(feedback)")}

    def _execute(self, sql: str, params=()):
        return self._db.execute(sql, params)

    def _executemany(self, sql: str, rows: list) -> None:
        self._db.executemany(sql, rows)

    def _begin(self, write: bool) -> None:
        # IMMEDIATE takes the write lock at once (waiting up to the busy timeout), so the check and the insert of a
        # label see one state; a read is a snapshot from its first SELECT to its COMMIT (WAL)
        self._db.execute("BEGIN IMMEDIATE" if write else "BEGIN")

    def close(self) -> None:
        with self._lock:
            self._db.close()
