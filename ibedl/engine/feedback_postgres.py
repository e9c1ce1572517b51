"""The feedback store on PostgreSQL (``IBEDL_FEEDBACK_DSN``), for replicas on several nodes: one database that every
replica connects to (psycopg 3). Writers take one transaction-level advisory lock, so labels commit one writer at a
time and ``seq`` grows in commit order, as in SQLite; a reader sees one snapshot (REPEATABLE READ). Every statement
and lock wait is bounded by the store's timeout (``statement_timeout``, ``lock_timeout``), and a lost connection is
opened again on the next call. The DSN holds a password: it never appears in a message, only :func:`redacted`."""

from __future__ import annotations

import logging
import math

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ibedl.engine.errors import StoreUnavailable
from ibedl.engine.feedback_sql import SqlStore

log = logging.getLogger("ibedl.engine.feedback_store")

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS feedback (
        seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        receipt_id TEXT NOT NULL UNIQUE,
        question TEXT NOT NULL,
        adapter TEXT NOT NULL,
        version TEXT NOT NULL,
        options INTEGER NOT NULL,
        label INTEGER NOT NULL,
        predicted INTEGER NOT NULL,
        answered INTEGER NOT NULL,
        target DOUBLE PRECISION,
        covered INTEGER,
        coverage DOUBLE PRECISION,
        adaptive_covered INTEGER,
        adaptive_coverage DOUBLE PRECISION,
        probs TEXT NOT NULL,
        alpha TEXT,
        issued DOUBLE PRECISION NOT NULL,
        recorded DOUBLE PRECISION NOT NULL,
        credential TEXT,
        calibration TEXT
    )""",
    # columns added since the first store: an older store gains them (its earlier labels: NULL)
    "ALTER TABLE feedback ADD COLUMN IF NOT EXISTS calibration TEXT",
    "CREATE INDEX IF NOT EXISTS feedback_by_credential ON feedback (credential, recorded)",
    "CREATE INDEX IF NOT EXISTS feedback_by_recorded ON feedback (recorded)",
    "CREATE TABLE IF NOT EXISTS feedback_state (series TEXT PRIMARY KEY, seq BIGINT NOT NULL, state BYTEA NOT NULL)",
    "CREATE TABLE IF NOT EXISTS feedback_checkpoint (id INTEGER PRIMARY KEY CHECK (id = 1), seq BIGINT NOT NULL)",
    "INSERT INTO feedback_checkpoint (id, seq) VALUES (1, 0) ON CONFLICT (id) DO NOTHING",
)
WRITE_LOCK = 0x1BED1_F33DBAC  # the advisory lock key every writer of the store takes (any constant; one per store)


def redacted(dsn: str) -> str:
    """The DSN as messages, logs and records may show it: host, port and database only; never the user, the password
    nor any other option (a URI's query may carry the password: ``?password=...``)."""
    try:
        parts = conninfo_to_dict(dsn)
    except psycopg.Error:  # its message would quote the DSN
        return "postgresql://(a DSN that does not parse)"
    port = f":{parts['port']}" if parts.get("port") else ""
    return f"postgresql://{parts.get('host', '')}{port}/{parts.get('dbname', '')}"


class PostgresStore(SqlStore):
    """The feedback store in the PostgreSQL database at ``dsn`` (its tables are created when missing).

    Args:
        dsn: a libpq connection string or URI (``postgresql://USER:PASSWORD@HOST:5432/DB?sslmode=require``).
        timeout_s: the longest connect, statement or lock wait.

    Raises:
        StoreUnavailable: the server cannot be reached or refuses the connection (a replica waits and tries again).
    """

    setting = "IBEDL_FEEDBACK_DSN"
    failures = (psycopg.OperationalError,)  # connection lost or refused, statement_timeout, lock_timeout

    def __init__(self, dsn: str, timeout_s: float = 5.0) -> None:
        super().__init__(redacted(dsn), timeout_s)
        self._dsn = dsn
        self._conn: psycopg.Connection | None = None
        try:
            with self._transaction(write=True):  # the write lock: two replicas creating the tables do not race
                for statement in SCHEMA:
                    self._execute(statement)
        except psycopg.Error as e:
            raise ValueError(f"cannot use the feedback store {self.where} ({self.setting}): {self._detail(e)}") \
                from None

    def _connection(self) -> psycopg.Connection:
        """The open connection; a new one when there is none or it broke."""
        if self._conn is None or self._conn.closed or self._conn.broken:
            if self._conn is not None:
                self._conn.close()
            ms = str(math.ceil(self.timeout_s * 1000))
            try:
                self._conn = psycopg.connect(self._dsn, autocommit=True, connect_timeout=max(2, math.ceil(
                    self.timeout_s)), application_name="ibedl")
            except psycopg.Error as e:  # where and why in the log alone: a client (or an open probe) learns neither
                log.warning("the feedback store (%s %s) cannot be reached: %s", self.setting, self.where,
                            self._detail(e))
                raise StoreUnavailable(f"the feedback store ({self.setting}) cannot be reached; the service log says "
                                       "why", retry_after=max(1, math.ceil(self.timeout_s))) from None
            for name in ("statement_timeout", "lock_timeout"):  # a wait longer than the timeout is an error
                self._conn.execute("SELECT set_config(%s, %s, false)", (name, ms))
        return self._conn

    def _execute(self, sql: str, params=()):
        return self._connection().execute(sql.replace("?", "%s"), params)

    def _executemany(self, sql: str, rows: list) -> None:
        with self._connection().cursor() as cursor:
            cursor.executemany(sql.replace("?", "%s"), rows)

    def _begin(self, write: bool) -> None:
        # a write is READ COMMITTED: after the lock, each statement sees the last writer's labels
        begin = "BEGIN" if write else "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"
        try:
            self._execute(begin)
        except psycopg.OperationalError:
            if not self._conn.broken:
                raise
            self._execute(begin)  # the server closed the idle connection (a restart, a failover): once more, anew
        if write:
            self._execute("SELECT pg_advisory_xact_lock(?)", (WRITE_LOCK,))

    def _rollback(self) -> None:
        if self._conn is not None and not self._conn.closed and not self._conn.broken:  # else nothing to roll back
            super()._rollback()

    def _detail(self, error: Exception) -> str:
        text = str(error).strip()
        secret = conninfo_password(self._dsn)
        for hidden in (self._dsn, secret):
            if hidden:
                text = text.replace(hidden, "***")
        return text

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()


def conninfo_password(dsn: str) -> str | None:
    """The password in ``dsn`` (to scrub it from messages), None when it holds none or does not parse."""
    try:
        return conninfo_to_dict(dsn).get("password") or None
    except psycopg.Error:
        return None
