"""The kinds of feedback store, one :data:`KINDS` line each, and the one place that chooses among them: what the
engine's settings name (:func:`open_store`, :func:`persistent`: the service, the Python API, the batch command) or a
location given on its own (:func:`open_store_at`: ``python -m ibedl.training.calibrate --dataset feedback --path``).
A kind's driver is imported only when a store of that kind is opened.

Another kind (a Redis store, say) is a :class:`~ibedl.engine.feedback_store.FeedbackStore` in a module of its own,
a setting that names it, and one line here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ibedl.engine.feedback_store import FeedbackStore
from ibedl.engine.settings import EngineSettings


@dataclass(frozen=True)
class StoreKind:
    """One kind of feedback store.

    Attributes:
        setting: the setting that names a store of this kind.
        configured: its location in the engine's settings (a DSN in the clear: never show it); None when they name
            none of this kind.
        open: ``(location, timeout_s, create)`` -> the store, which may create it unless ``create`` is false
            (FileNotFoundError then, for a store that does not exist yet).
        claims: whether a location given on its own is of this kind (None: SQLite's, which takes any location no
            other kind claims: a file).
    """

    setting: str
    configured: Callable[[EngineSettings], str | None]
    open: Callable[[str, float, bool], FeedbackStore]
    claims: Callable[[str], bool] | None = None


def is_dsn(location) -> bool:
    """Whether ``location`` is a PostgreSQL DSN (a postgresql:// URI, or a libpq ``key=value`` string that libpq
    parses) rather than a file."""
    text = str(location).strip()
    if text.startswith(("postgresql://", "postgres://")):
        return True
    if "=" not in text:
        return False
    try:
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:  # no PostgreSQL driver: judge by libpq's keywords
        return bool(re.match(r"(host|hostaddr|port|dbname|user|password)\s*=", text))
    try:
        return bool(conninfo_to_dict(text))
    except Exception:  # noqa: BLE001 - psycopg's parse error: not a DSN
        return False


def _sqlite(location: str | None, timeout_s: float, create: bool = True) -> FeedbackStore:
    """The SQLite store in the file ``location``; in memory, per process, when None."""
    from ibedl.engine.feedback_sqlite import SqliteStore

    path = None if location is None else Path(location)
    if path is not None and not create and not path.is_file():
        raise FileNotFoundError(f"no feedback store at {location} (the service's {SQLITE.setting})")
    return SqliteStore(path, timeout_s)


def _postgres(dsn: str, timeout_s: float, create: bool = True) -> FeedbackStore:
    """The PostgreSQL store at ``dsn`` (its tables are created when missing, whatever ``create`` says: the database
    itself must exist)."""
    from ibedl.engine.feedback_postgres import PostgresStore

    return PostgresStore(dsn, timeout_s)


SQLITE = StoreKind("IBEDL_FEEDBACK_DB", lambda s: None if s.feedback_db is None else str(s.feedback_db), _sqlite)
KINDS = (
    SQLITE,
    StoreKind("IBEDL_FEEDBACK_DSN", lambda s: None if s.feedback_dsn is None else s.feedback_dsn.get_secret_value(),
              _postgres, claims=is_dsn),
)
STORE_SETTINGS = " or ".join(kind.setting for kind in KINDS)  # what names a store, for messages


def persistent(settings: EngineSettings) -> bool:
    """Whether ``settings`` name a store outside this process (shared by replicas, kept across restarts); else the
    labels live in memory, per process."""
    return any(kind.configured(settings) is not None for kind in KINDS)


def open_store(settings: EngineSettings) -> FeedbackStore:
    """The store ``settings`` name (at most one kind does: ``EngineSettings`` refuses two), with their
    ``feedback_timeout_s``; without one, SQLite in memory. ValueError when it cannot be used; StoreUnavailable when it
    does not answer (yet)."""
    for kind in KINDS:
        location = kind.configured(settings)
        if location is not None:
            return kind.open(location, settings.feedback_timeout_s, True)
    return _sqlite(None, settings.feedback_timeout_s)


def kind_at(location) -> StoreKind:
    """The kind of store ``location`` names: the first kind that claims it, else a SQLite file."""
    return next((kind for kind in KINDS if kind.claims is not None and kind.claims(str(location))), SQLITE)


def open_store_at(location, timeout_s: float) -> FeedbackStore:
    """The existing store at ``location``, as a command line names it: a PostgreSQL DSN (its password never shown)
    or a SQLite file (FileNotFoundError when there is none: a reader does not create an empty store).
    ValueError when it cannot be used; StoreUnavailable when it does not answer."""
    return kind_at(location).open(str(location), timeout_s, False)
