"""The one place that chooses a feedback store (``ibedl.engine.feedback_kinds``): what the engine's settings name (a
SQLite file, a PostgreSQL DSN, else memory), a location given on its own (a command line's ``--path``: a DSN or an
existing file, never a new empty one), and another kind added by one registry line."""

from __future__ import annotations

import sys

import pytest

from ibedl.engine import feedback_kinds
from ibedl.engine.feedback_kinds import (
    KINDS,
    STORE_SETTINGS,
    StoreKind,
    is_dsn,
    kind_at,
    open_store,
    open_store_at,
    persistent,
)
from ibedl.engine.feedback_sqlite import SqliteStore
from ibedl.engine.settings import EngineSettings

DSNS = ["postgresql://u@db.example:5432/ibedl?password=s3cret&sslmode=require",
        "postgres://u:s3cret@db.example/ibedl",
        "host=db.example port=5432 dbname=ibedl user=u password=s3cret"]
FILES = ["runs/feedback.sqlite", "runs/a=b.sqlite", "/data/feedback.db"]


class TestSettings:
    def test_a_file_is_sqlite_with_the_settings_timeout_and_none_is_memory(self, tmp_path):
        db = tmp_path / "f.sqlite"
        store = open_store(EngineSettings(feedback_db=db, feedback_timeout_s=2))
        assert isinstance(store, SqliteStore) and store.path == db and store.timeout_s == 2
        assert store.journal == "wal" and db.is_file()
        memory = open_store(EngineSettings())
        assert isinstance(memory, SqliteStore) and memory.journal == "memory" and memory.path is None

    def test_persistent_is_any_store_outside_the_process(self, tmp_path):
        assert persistent(EngineSettings(feedback_db=tmp_path / "f.sqlite"))
        assert persistent(EngineSettings(feedback_dsn="postgresql://u:pw-1234@db:5432/x"))  # not connected to
        assert not persistent(EngineSettings())
        assert STORE_SETTINGS == "IBEDL_FEEDBACK_DB or IBEDL_FEEDBACK_DSN"

    @pytest.mark.servers
    def test_a_dsn_is_postgresql(self, postgres_dsn):
        from ibedl.engine.feedback_postgres import PostgresStore

        store = open_store(EngineSettings(feedback_dsn=postgres_dsn, feedback_timeout_s=2))
        assert isinstance(store, PostgresStore) and store.timeout_s == 2
        store.close()


class TestLocation:
    @pytest.mark.parametrize("location", DSNS)
    def test_a_dsn_is_postgresqls(self, location):
        assert is_dsn(location) and kind_at(location).setting == "IBEDL_FEEDBACK_DSN"

    @pytest.mark.parametrize("location", FILES)
    def test_anything_else_is_a_sqlite_file(self, location):
        assert not is_dsn(location) and kind_at(location).setting == "IBEDL_FEEDBACK_DB"

    def test_without_the_driver_a_dsn_is_judged_by_libpqs_keywords(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "psycopg.conninfo", None)  # the import fails
        assert is_dsn(DSNS[2]) and is_dsn(DSNS[0]) and not is_dsn("runs/a=b.sqlite")

    def test_an_existing_file_is_opened_and_a_missing_one_is_not_created(self, tmp_path):
        db = tmp_path / "f.sqlite"
        SqliteStore(db).add([{"receipt_id": "a", "question": "q", "adapter": "default", "version": "4", "options": 4,
                              "label": 1, "predicted": 1, "answered": 1, "target": None, "covered": None,
                              "coverage": None, "adaptive_covered": None, "adaptive_coverage": None,
                              "probs": "[0.5, 0.5]", "alpha": None, "issued": 1.0, "recorded": 2.0,
                              "credential": None, "calibration": None}])
        store = open_store_at(str(db), 30.0)
        assert isinstance(store, SqliteStore) and store.timeout_s == 30
        assert [r["receipt_id"] for r in store.labelled("default", "4")] == ["a"]
        missing = tmp_path / "none.sqlite"
        with pytest.raises(FileNotFoundError, match=r"no feedback store at .*none.sqlite \(the service's "
                                                    r"IBEDL_FEEDBACK_DB\)"):
            open_store_at(missing, 30.0)
        assert not missing.exists()

    @pytest.mark.servers
    def test_a_dsn_opens_postgresql(self, postgres_dsn):
        from ibedl.engine.feedback_postgres import PostgresStore

        store = open_store_at(postgres_dsn, 2.0)
        assert isinstance(store, PostgresStore) and store.labelled("default", "4") == []
        store.close()


class TestRegistry:
    def test_a_kind_added_by_one_line_is_chosen_by_its_setting_and_its_location(self, monkeypatch):
        opened = []

        def open_(location: str, timeout_s: float, create: bool):
            opened.append((location, timeout_s, create))
            return "a store"

        kind = StoreKind("IBEDL_FEEDBACK_TEST", configured=lambda s: "memory://from-settings", open=open_,
                         claims=lambda location: location.startswith("memory://"))
        monkeypatch.setattr(feedback_kinds, "KINDS", (*KINDS, kind))
        assert open_store_at("memory://cli", 3.0) == "a store" and kind_at("runs/f.sqlite").setting == \
            "IBEDL_FEEDBACK_DB"
        assert open_store(EngineSettings(feedback_timeout_s=4)) == "a store"
        assert persistent(EngineSettings())
        assert opened == [("memory://cli", 3.0, False), ("memory://from-settings", 4.0, True)]
