"""The service on its feedback store: two apps (two replicas) on one PostgreSQL database count a label once and
report the same bounds; the DSN's password is never on /v1/models, in the readiness reason or the log, nor the
receipt key or DSN in the settings errors; a store that waits answers 503 store_unavailable while /metrics still
answers at once; a store that does not answer at start keeps the replica loading (not failed) until it does."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time

import pytest

from ibedl.serve.__main__ import main
from tests.http_json import ok_json

KEY = "test-feedback-key"
Q = {"question": "Which gas do plants take in?", "options": ["oxygen", "carbon dioxide", "nitrogen"]}


def label(client, receipt: str, letter: str = "B"):
    return client.post("/v1/feedback", json={"receipt": receipt, "label": letter})


def guarantees(client) -> list[dict]:
    return ok_json(client.get("/v1/guarantees"))["guarantees"]


@pytest.mark.servers
def test_two_replicas_on_one_postgresql_database(make_client, postgres_server, postgres_dsn, caplog):
    password = postgres_server.password
    caplog.set_level(logging.DEBUG)
    with make_client(feedback_key=KEY, feedback_dsn=postgres_dsn) as one, \
            make_client(feedback_key=KEY, feedback_dsn=postgres_dsn) as two:
        answers = [ok_json(one.post("/predict", json=Q)) for _ in range(3)]
        assert ok_json(label(one, answers[0]["receipt"]))["recorded"] == 1
        assert ok_json(label(two, answers[0]["receipt"]))["duplicates"] == 1  # the other replica: counted once
        assert ok_json(label(two, answers[1]["receipt"], "A"))["recorded"] == 1
        conflict = label(one, answers[1]["receipt"], "C")  # its first label stands, whichever replica has it
        assert conflict.status_code == 409 and conflict.json()["error"]["type"] == "label_conflict"
        shared = guarantees(one)
        assert shared == guarantees(two)
        assert {g["guarantee"]: g["labels"] for g in shared}["answered_share"] == 2
        assert ok_json(one.get("/v1/guarantees"))["shared_store"] is True
        for text in (one.get("/v1/models").text, one.get("/health/ready").text, one.get("/metrics").text,
                     caplog.text):
            assert password not in text and postgres_dsn not in text


@pytest.mark.servers
def test_a_postgresql_restart_loses_no_acknowledged_label_and_counts_none_twice(make_client):
    """Labels flow while the PostgreSQL server restarts (fast shutdown: every connection dropped): the labels sent
    meanwhile get 503 store_unavailable, and a client that sends them again (as the 503 says) gets each acknowledged
    once; the store then holds every acknowledged label exactly once, the realised guarantees count each once, and
    the service answers and records without a restart of its own."""
    import psycopg

    from tests.postgres import PostgresServer

    with PostgresServer() as server:
        dsn = server.create_database("restart")
        with make_client(feedback_key=KEY, feedback_dsn=dsn, feedback_timeout_s=2) as client:
            answers = ok_json(client.post("/predict/batch", json={"items": [Q] * 30}))["results"]
            answers += ok_json(client.post("/predict/batch", json={"items": [Q] * 30}))["results"]
            halfway, restarted = threading.Event(), threading.Event()

            def restart():
                assert halfway.wait(120)
                server.restart()
                restarted.set()

            restarter = threading.Thread(target=restart)
            restarter.start()
            acknowledged, unavailable = {}, 0
            for i, answer in enumerate(answers):
                if i == 20:
                    halfway.set()  # the server goes down while the next labels are sent
                deadline = time.monotonic() + 120
                while True:  # sent again on 503, as the answer says; each attempt waits at most the store's timeout
                    r = label(client, answer["receipt"])
                    if r.status_code == 200:
                        acknowledged[answer["receipt"]] = r.json()["results"][0]["status"]
                        break
                    assert r.status_code == 503 and r.json()["error"]["type"] == "store_unavailable", r.text
                    assert time.monotonic() < deadline, "the store never came back"
                    unavailable += 1
            restarter.join(120)
            assert restarted.is_set() and unavailable >= 1  # the restart was felt
            assert len(acknowledged) == 60
            with psycopg.connect(dsn) as conn:
                rows, receipts = conn.execute("SELECT COUNT(*), COUNT(DISTINCT receipt_id) FROM feedback").fetchone()
            assert rows == receipts == 60  # every acknowledged label kept, none twice
            assert {g["guarantee"]: g["labels"] for g in guarantees(client)}["answered_share"] == 60
            assert client.get("/health/ready").status_code == 200
            fresh = ok_json(client.post("/predict", json=Q))
            assert ok_json(label(client, fresh["receipt"]))["recorded"] == 1


def test_a_store_that_waits_is_a_503_and_metrics_still_answer(make_client, tmp_path):
    """Another replica holds the SQLite write lock: a label waits the timeout on the store's own thread and gets
    503 store_unavailable with Retry-After; a scrape meanwhile answers within about a second, its gauges as they
    were."""
    db = tmp_path / "feedback.sqlite"
    with make_client(feedback_key=KEY, feedback_db=db, feedback_timeout_s=3) as client:
        answers = [ok_json(client.post("/predict", json=Q)) for _ in range(2)]
        assert ok_json(label(client, answers[0]["receipt"]))["recorded"] == 1
        assert client.get("/metrics").status_code == 200
        store = client.app.state.service.engine.feedback.store
        add, writing = store.add, threading.Event()

        def add_after_telling(*args, **kwargs):  # on the store's thread, as the label's write takes the lock
            writing.set()
            return add(*args, **kwargs)

        store.add = add_after_telling
        holder = sqlite3.connect(db, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            waiting = {}
            writer = threading.Thread(target=lambda: waiting.update(r=label(client, answers[1]["receipt"])))
            writer.start()
            assert writing.wait(30), "the label never reached the store"  # it waits for the lock on that thread
            start = time.monotonic()
            scrape = client.get("/metrics")
            assert scrape.status_code == 200 and time.monotonic() - start < 2.5
            assert "ibedl_guarantee_labels" in scrape.text
            assert "r" not in waiting  # answered while the label still waited (its wait is 3 s)
            writer.join(timeout=30)
            r = waiting["r"]
            assert r.status_code == 503 and r.json()["error"]["type"] == "store_unavailable"
            assert r.headers["Retry-After"] == "3"
        finally:
            holder.execute("ROLLBACK")
        assert ok_json(label(client, answers[1]["receipt"]))["recorded"] == 1  # the lock gone: recorded


def test_a_store_that_does_not_answer_at_start_keeps_the_replica_loading(make_client, caplog):
    """Nothing listens at the DSN (a database still starting): the replica stays loading, saying why, rather than
    failing for good. The probe is open to anyone: it names the setting, not the database's host, port, name or user
    (the log does, without the password)."""
    dsn = "postgresql://ibedl:pw-not-shown@127.0.0.1:1/feedback"
    with caplog.at_level("WARNING", logger="ibedl.engine.feedback_store"), \
            make_client(ready=False, feedback_key=KEY, feedback_dsn=dsn, feedback_timeout_s=1) as client:
        deadline = time.monotonic() + 60
        while True:
            r = client.get("/health/ready")
            assert r.status_code == 503 and r.json()["status"] == "loading"
            if "waiting for the feedback store" in (r.json()["reason"] or ""):
                break
            assert time.monotonic() < deadline, r.text
            time.sleep(0.2)
        assert r.json()["reason"] == ("waiting for the feedback store: the feedback store (IBEDL_FEEDBACK_DSN) cannot "
                                      "be reached; the service log says why")
    # the log: host, port and database; neither the password nor the user
    assert "postgresql://127.0.0.1:1/feedback" in caplog.text and "Connection refused" in caplog.text
    assert "pw-not-shown" not in caplog.text and "ibedl@" not in caplog.text


class TestSettingsErrors:
    """What an operator sees for bad settings: the rule, never the secret."""

    def test_an_invalid_receipt_key_is_not_printed(self, monkeypatch, capsys):
        monkeypatch.setenv("IBEDL_FEEDBACK_KEY", "short-secret")
        assert main(["--port", "0"]) == 2
        err = capsys.readouterr().err
        assert "IBEDL_FEEDBACK_KEY: Value error, feedback_key must be at least 16 characters" in err
        assert "short-secret" not in err

    def test_a_dsn_is_not_printed(self, monkeypatch, capsys):
        monkeypatch.setenv("IBEDL_FEEDBACK_DSN", "mysql://ibedl:pw-1234@db/feedback")
        assert main(["--port", "0"]) == 2
        err = capsys.readouterr().err
        assert "IBEDL_FEEDBACK_DSN: Value error, feedback_dsn must be a PostgreSQL URI" in err and "pw-1234" not in err

    def test_a_rule_across_settings_shows_no_input(self, monkeypatch, capsys, tmp_path):
        monkeypatch.setenv("IBEDL_API_TOKEN", "api-token-not-shown")
        monkeypatch.setenv("IBEDL_FEEDBACK_DSN", "postgresql://ibedl:pw-1234@db/feedback")
        monkeypatch.setenv("IBEDL_FEEDBACK_DB", str(tmp_path / "f.sqlite"))
        assert main([]) == 2  # every field valid: the rule across them is what fails
        err = capsys.readouterr().err
        assert "IBEDL_FEEDBACK_DB and IBEDL_FEEDBACK_DSN both name a feedback store" in err
        assert "pw-1234" not in err and "api-token-not-shown" not in err
