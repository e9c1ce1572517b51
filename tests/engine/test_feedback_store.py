"""The feedback store behind two engines (two services), on SQLite and on a real PostgreSQL server (tests/postgres.py,
marked ``servers``): a label counts once across replicas, concurrent writers (threads and processes) keep one count
and one set of states, a restart loads the checkpoint's states and reports what a full replay reports, bit for bit
(the adaptive thresholds too), retention deletes old raw labels while the guarantees keep counting them, SQLite runs
in WAL mode, a store that waits longer than its timeout answers StoreUnavailable, the DSN's password is never in a
message, and a store written against the domain interface alone (dicts, no SQL) serves the engine as SQLite does."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ibedl.engine.errors import LabelConflict, ReceiptExpired, StoreUnavailable, TooLarge, TooManyLabels
from ibedl.engine.feedback import Feedback
from ibedl.engine.feedback_kinds import open_store
from ibedl.engine.feedback_sqlite import SCHEMA, SqliteStore
from ibedl.engine.feedback_store import REPLAYED, Checkpoint, FeedbackStore, LabelQuota
from ibedl.engine.receipts import Receipt, new_id, sign
from ibedl.engine.settings import EngineSettings

KEY = "k" * 32
SERVED = {"default": "4"}
DAY = 86400.0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.servers)])
def where(request, tmp_path) -> dict:
    """The settings that name a store every engine of the test shares: a SQLite file, or a PostgreSQL database."""
    if request.param == "sqlite":
        return {"feedback_db": tmp_path / "feedback.sqlite"}
    return {"feedback_dsn": request.getfixturevalue("postgres_dsn")}


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def engine(where: dict, clock=None, runtimes: dict | None = None, store=None, **extra) -> Feedback:
    """One service's feedback engine on the shared store (``store``: a wrapper to open it through)."""
    feedback = Feedback(EngineSettings(feedback_key=KEY, **where, **extra), **({} if clock is None else
                                                                                {"clock": clock}))
    feedback.store = store
    feedback.bind(runtimes or {})
    return feedback


class FullReplay:
    """A store as the version before checkpoints read it: no states, every stored label from the first; it writes
    nothing. An engine on it folds every label: the reference a checkpointed start must equal."""

    def __init__(self, store) -> None:
        self.store = store

    def read(self, after: int, limit: int) -> Checkpoint:
        return Checkpoint(0, {}, self.store.since(after)[:limit])

    def save(self, *args) -> bool:
        return False


class Reads:
    """A store that counts what its reads returned: states restored and labels replayed."""

    def __init__(self, store) -> None:
        self.store, self.states, self.rows = store, 0, 0

    def read(self, after: int, limit: int) -> Checkpoint:
        checkpoint = self.store.read(after, limit)
        self.states += len(checkpoint.states)
        self.rows += len(checkpoint.rows)
        return checkpoint

    def __getattr__(self, name):
        return getattr(self.store, name)


def token(now: float, label_of: int = 1, answered: bool = True, covered: bool | None = True,
          adaptive: bool | None = None, receipt_id: str | None = None) -> str:
    """A signed receipt of adapter default version 4 issued at ``now``: predicted option 1 (B), its set {B, C} when
    ``covered`` is not None, its adaptive set {B} when ``adaptive`` is not None."""
    r = Receipt(id=receipt_id or new_id(), question="q", adapter="default", version="4", options=4, predicted=1,
                answered=answered, set=None if covered is None else (1, 2), coverage=None if covered is None else 0.9,
                adaptive_set=None if adaptive is None else (1,), adaptive_coverage=None if adaptive is None else 0.9,
                target=0.9, probs=(0.1, 0.6, 0.25, 0.05), alpha=None, issued=int(now), expires=int(now) + 30 * 86400)
    return sign(r, KEY.encode())


def labels(now: float, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (receipt, label) pairs: right (B) about 4 times in 5, with sets and adaptive sets."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        letter = "B" if rng.random() < 0.8 else rng.choice("ACD")
        out.append((token(now, answered=rng.random() < 0.9, adaptive=True), letter))
    return out


def reported(feedback: Feedback) -> list[dict]:
    return feedback.guarantees(SERVED)


def counts(feedback: Feedback) -> dict:
    return {(g["guarantee"], g["stated"]): (g["labels"], g["hits"]) for g in reported(feedback)}


class TestReplicas:
    def test_a_label_counts_once_across_two_services(self, where):
        clock = Clock()
        one, two = engine(where, clock), engine(where, clock)
        (receipt, letter), (other, _) = labels(clock.now, 2)
        assert [r["status"] for r in one.record(SERVED, [(receipt, letter)])] == ["recorded"]
        assert [r["status"] for r in two.record(SERVED, [(receipt, letter)])] == ["duplicate"]
        assert [r["status"] for r in two.record(SERVED, [(other, "B")])] == ["recorded"]
        assert counts(one) == counts(two) and counts(one)[("answered_share", None)][0] == 2
        assert reported(one) == reported(two)

    def test_concurrent_writers_keep_one_count_and_one_state(self, where):
        """Four services in four threads, each on its own connection, record labels one by one, a quarter of them
        the same receipts as another thread's: each label counts once, and every service, a restarted one and a
        full replay report the same bounds."""
        clock = Clock()
        shared = labels(clock.now, 20, seed=99)
        batches = [labels(clock.now, 40, seed=i) + shared for i in range(4)]
        services = [engine(where, clock) for _ in batches]
        errors = []

        def write(service, batch):
            try:
                for item in batch:
                    service.record(SERVED, [item])
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        threads = [threading.Thread(target=write, args=pair) for pair in zip(services, batches, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors
        unique = 4 * 40 + 20
        assert counts(services[0])[("answered_share", None)][0] == unique
        assert len(services[0].store.since(0)) == unique
        expected = reported(engine(where, clock, store=FullReplay(open_store(EngineSettings(**where)))))
        for service in services:
            assert reported(service) == expected
        assert reported(engine(where, clock)) == expected

    def test_concurrent_processes_keep_one_count_and_one_state(self, where, tmp_path):
        """Three processes (three replicas) record labels at once, a shared set in each; then one store."""
        clock = Clock()
        shared = labels(clock.now, 10, seed=7)
        go = tmp_path / "go"
        writers = []
        for i in range(3):
            batch = tmp_path / f"batch{i}.json"
            batch.write_text(json.dumps(labels(clock.now, 30, seed=100 + i) + shared))
            settings = {k: str(v) for k, v in where.items()}
            writers.append(subprocess.Popen(
                [sys.executable, "-c", WRITER, json.dumps(settings), str(batch), str(go), str(clock.now),
                 str(tmp_path / f"ready{i}")], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{i}").exists() for i in range(3)):  # each on its store, waiting for go
            for w in writers:
                assert w.poll() is None, w.communicate()[1]
            assert time.monotonic() < deadline, "the writers never got ready"
            time.sleep(0.01)
        go.touch()  # all three start recording together
        statuses = []
        for w in writers:
            out, err = w.communicate(timeout=300)
            assert w.returncode == 0, err
            statuses += json.loads(out)
        # each label recorded by exactly one replica; the shared ones are the others' duplicates
        assert statuses.count("recorded") == 3 * 30 + 10 and statuses.count("duplicate") == 2 * 10
        reference = engine(where, clock, store=FullReplay(open_store(EngineSettings(**where))))
        assert counts(reference)[("answered_share", None)][0] == 3 * 30 + 10
        assert reported(engine(where, clock)) == reported(reference)


# a replica in a process of its own: once its store is open it creates the ready file, then records each label of a
# batch on its own once the go file exists
WRITER = """
import json, sys, time
from pathlib import Path
from ibedl.engine.feedback import Feedback
from ibedl.engine.settings import EngineSettings
where, batch = json.loads(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
go, now, ready = Path(sys.argv[3]), float(sys.argv[4]), Path(sys.argv[5])
feedback = Feedback(EngineSettings(feedback_key="k" * 32, **where), clock=lambda: now)
feedback.bind({})
ready.touch()
while not go.exists():
    time.sleep(0.01)
print(json.dumps([feedback.record({"default": "4"}, [tuple(item)])[0]["status"] for item in batch]))
"""


class TestCheckpoint:
    def test_a_restart_loads_the_states_and_reports_what_a_full_replay_does(self, where):
        """A service records 300 labels (a checkpoint per label); a restarted one reads the states and no label,
        and reports the same bounds, change detectors, suspension and adaptive threshold as a replica that folds
        every label."""
        clock = Clock()
        runtime = SimpleNamespace(name="default", ref={"version": "4"},
                                  conformal=SimpleNamespace(quantile=lambda: 0.4, alpha=0.1))
        first = engine(where, clock, {"default": runtime}, adaptive_sets=True)
        for item in labels(clock.now, 300):
            first.record(SERVED, [item])
        reads = Reads(open_store(EngineSettings(**where)))
        restarted = engine(where, clock, {"default": runtime}, store=reads, adaptive_sets=True)
        found = reported(first)
        detectors = sum(len(g["change"]) for g in found)  # one per stated guarantee: every label has 4 options
        suspended = {g["suspended"]["since"] for g in found if g["suspended"]}  # the labels break the 0.9 promise
        assert reads.rows == 0 and len(found) == 4 and detectors == 2 and len(suspended) == 1
        assert reads.states == len(found) + detectors + 1  # sequences, detectors, the version's suspension
        replay = engine(where, clock, {"default": runtime}, adaptive_sets=True,
                        store=FullReplay(open_store(EngineSettings(**where))))
        assert reported(restarted) == reported(replay) == reported(first)
        tracker = restarted._trackers[("default", "4")]
        assert tracker.labels == 300 and tracker.quantile == replay._trackers[("default", "4")].quantile
        assert tracker.quantile == first._trackers[("default", "4")].quantile
        # a label after the restart moves both alike
        (item,) = labels(clock.now, 1, seed=5)
        restarted.record(SERVED, [item])
        first.refresh()
        assert reported(first) == reported(restarted)

    def test_a_replica_behind_the_checkpoint_takes_its_states(self, where):
        """Labels another service recorded reach this one through the checkpoint's states, as if it had folded
        them (it reads no label it has not seen)."""
        clock = Clock()
        reads = Reads(open_store(EngineSettings(**where)))
        behind = engine(where, clock, store=reads)
        ahead = engine(where, clock)
        for item in labels(clock.now, 50):
            ahead.record(SERVED, [item])
        before = reads.rows
        assert reported(behind) == reported(ahead)
        assert reads.rows == before and reads.states > 0

    def test_retention_deletes_old_labels_and_the_guarantees_keep_counting_them(self, where):
        clock = Clock()
        service = engine(where, clock, feedback_retention_days=30)
        old = labels(clock.now, 40)
        for item in old:
            service.record(SERVED, [item])
        clock.now += 31 * DAY  # the old labels are past the retention, their receipts past the 30-day TTL
        for item in labels(clock.now, 5, seed=1):
            service.record(SERVED, [item])
        assert len(service.store.since(0)) == 5  # the raw labels left
        assert counts(service)[("answered_share", None)][0] == 45
        assert reported(engine(where, clock)) == reported(service)  # a restart counts them too
        with pytest.raises(ReceiptExpired):  # a deleted label's receipt cannot be labelled again
            service.record(SERVED, [old[0]])

    def test_no_retention_keeps_every_label(self, where):
        clock = Clock()
        service = engine(where, clock, feedback_retention_days=0)
        for item in labels(clock.now, 10):
            service.record(SERVED, [item])
        clock.now += 400 * DAY
        for item in labels(clock.now, 1, seed=1):
            service.record(SERVED, [item])
        assert len(service.store.since(0)) == 11


class TestSqlite:
    def test_wal_mode(self, tmp_path):
        db = tmp_path / "f.sqlite"
        assert SqliteStore(db).journal == "wal"
        with sqlite3.connect(db) as conn:  # the file's mode, as every other connection finds it
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"

    def test_a_store_of_the_previous_version_is_replayed_once_then_started_from_its_states(self, tmp_path):
        """A file with labels and no checkpoint (written before checkpoints): the first service folds every label
        and writes the checkpoint; the next one starts from it."""
        clock, db = Clock(), tmp_path / "old.sqlite"
        with sqlite3.connect(db) as conn:
            conn.execute(SCHEMA)
        source = engine({"feedback_db": db}, clock)
        for item in labels(clock.now, 30):
            source.record(SERVED, [item])
        with sqlite3.connect(db) as conn:  # back to the previous version's file: the labels only
            conn.execute("DROP TABLE feedback_state")
            conn.execute("DROP TABLE feedback_checkpoint")
        reads = Reads(SqliteStore(db))
        upgraded = engine({"feedback_db": db}, clock, store=reads)
        assert reads.rows == 30 and reported(upgraded) == reported(source)
        reads = Reads(SqliteStore(db))
        assert reported(engine({"feedback_db": db}, clock, store=reads)) == reported(source)
        assert reads.rows == 0

    def test_a_held_write_lock_is_waited_for_at_most_the_timeout(self, tmp_path):
        db = tmp_path / "f.sqlite"
        clock = Clock()
        service = engine({"feedback_db": db}, clock, feedback_timeout_s=0.3)
        holder = sqlite3.connect(db, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # another replica's write, stuck
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match="did not answer within 0.3 s") as e:
            service.record(SERVED, labels(clock.now, 1))
        assert time.monotonic() - start < 3 and e.value.retry_after == 1
        holder.execute("ROLLBACK")
        assert [r["status"] for r in service.record(SERVED, labels(clock.now, 1, seed=3))] == ["recorded"]


@pytest.mark.servers
class TestPostgres:
    def test_a_held_write_lock_is_waited_for_at_most_the_timeout(self, postgres_dsn):
        import psycopg

        from ibedl.engine.feedback_postgres import WRITE_LOCK

        clock = Clock()
        service = engine({"feedback_dsn": postgres_dsn}, clock, feedback_timeout_s=0.5)
        with psycopg.connect(postgres_dsn, autocommit=True) as holder:
            holder.execute("SELECT pg_advisory_lock(%s)", (WRITE_LOCK,))  # another replica's write, stuck
            start = time.monotonic()
            with pytest.raises(StoreUnavailable, match="did not answer within 0.5 s"):
                service.record(SERVED, labels(clock.now, 1))
            assert time.monotonic() - start < 3
        assert [r["status"] for r in service.record(SERVED, labels(clock.now, 1, seed=3))] == ["recorded"]

    def test_a_lost_connection_is_opened_again(self, postgres_dsn):
        import psycopg

        clock = Clock()
        service = engine({"feedback_dsn": postgres_dsn}, clock)
        service.record(SERVED, labels(clock.now, 1))
        with psycopg.connect(postgres_dsn, autocommit=True) as admin:  # the server drops the service's connection
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'ibedl'")
        assert [r["status"] for r in service.record(SERVED, labels(clock.now, 1, seed=2))] == ["recorded"]
        assert counts(service)[("answered_share", None)][0] == 2

    def test_the_password_is_never_in_a_message_and_where_and_why_only_in_the_log(self, postgres_server,
                                                                                    postgres_dsn, caplog):
        """A client (and the open readiness probe, which shows the reason while the store is awaited) learns that the
        store cannot be reached, not the database's host, port, name or user: those go to the log, without the
        password."""
        from ibedl.engine.feedback_postgres import PostgresStore

        password = postgres_server.password
        wrong = postgres_dsn.replace(password, "not-" + password)
        with caplog.at_level("WARNING", logger="ibedl.engine.feedback_store"), \
                pytest.raises(StoreUnavailable) as e:  # authentication fails
            PostgresStore(wrong, 2)
        assert e.value.message == ("the feedback store (IBEDL_FEEDBACK_DSN) cannot be reached; the service log says "
                                   "why")
        assert "password authentication failed" in caplog.text and password not in caplog.text
        assert f"postgresql://127.0.0.1:{postgres_server.port}/" in caplog.text  # host, port, database only
        closed = postgres_dsn.replace(f":{postgres_server.port}/", ":1/")
        with caplog.at_level("WARNING", logger="ibedl.engine.feedback_store"), \
                pytest.raises(StoreUnavailable) as e:  # nothing listens
            PostgresStore(closed, 2)
        assert "127.0.0.1" not in e.value.message and "postgresql://127.0.0.1:1/" in caplog.text
        assert password not in caplog.text
        store = PostgresStore(postgres_dsn, 2)
        assert password not in store.where and password not in repr(vars(store).get("where"))


class DictStore(FeedbackStore):
    """A store written against the domain interface alone, in dicts: no SQL, no ``SqlStore``. Its write is atomic
    (one lock; inserts applied when the write ends, none when it raises), as a Redis store's MULTI would be."""

    setting = "a test's dicts"

    def __init__(self) -> None:
        super().__init__("memory", 1.0)
        self.rows: dict[int, dict] = {}  # by seq, in commit order
        self.seq_of: dict[str, int] = {}  # by receipt id
        self.states: dict[tuple, tuple[int, bytes]] = {}  # series -> (seq written at, state)
        self.checkpoint = self.last = 0
        self._lock = threading.Lock()
        self._pending: list[dict] = []

    @contextlib.contextmanager
    def _writing(self):
        with self._lock:
            self._pending = []
            yield
            for row in self._pending:
                self.last += 1
                self.rows[self.last] = {"seq": self.last, **row}
                self.seq_of[row["receipt_id"]] = self.last

    def _labels_of(self, receipt_ids: list[str]) -> dict[str, int]:
        return {rid: self.rows[self.seq_of[rid]]["label"] for rid in receipt_ids if rid in self.seq_of}

    def _insert(self, rows: list[dict]) -> None:
        self._pending += [dict(row) for row in rows]

    def _window(self, credential: str, since: float) -> list[float]:
        return sorted(r["recorded"] for r in self.rows.values() if r["credential"] == credential
                      and r["recorded"] > since)

    def _count_recorded(self, credential: str, since: float) -> int:
        return len(self._window(credential, since))

    def _recorded_at(self, credential: str, since: float, rank: int) -> float:
        return self._window(credential, since)[rank]

    def since(self, seq: int) -> list[dict]:
        with self._lock:
            return [dict(r) for s, r in self.rows.items() if s > seq]

    def labelled(self, adapter: str, version: str, from_seq: int = 0) -> list[dict]:
        return [r for r in self.since(from_seq - 1) if (r["adapter"], r["version"]) == (adapter, version)]

    def _read(self, after: int, limit: int) -> Checkpoint:
        with self._lock:
            states = {} if self.checkpoint <= after else {
                series: state for series, (seq, state) in self.states.items() if seq > after}
            rows = [{c: r[c] for c in REPLAYED} for s, r in self.rows.items() if s > max(after, self.checkpoint)]
            return Checkpoint(self.checkpoint, states, rows[:limit])

    def state(self, series) -> bytes | None:
        with self._lock:
            return self.states.get(tuple(series), (0, None))[1]

    def save(self, seq: int, states: dict, prune_before: float | None = None) -> bool:
        with self._writing():
            if self.checkpoint >= seq:
                return False
            self.states.update({tuple(series): (seq, state) for series, state in states.items()})
            self.checkpoint = seq
            for s in [s for s, r in self.rows.items() if prune_before is not None and r["recorded"] < prune_before
                      and s <= seq]:
                del self.seq_of[self.rows.pop(s)["receipt_id"]]
        return True

    def close(self) -> None:
        pass


class TestDomainInterface:
    def test_a_store_written_against_the_interface_alone_serves_the_engine(self, tmp_path):
        """The engine on :class:`DictStore` records, finds duplicates, refuses a conflict (writing nothing of its
        request), counts a credential's quota, and reports what it reports on SQLite for the same labels; a restart
        from the dict store's checkpoint reads no label and reports the same."""
        clock = Clock()
        store = DictStore()
        service, sqlite = engine({}, clock, store=store), engine({"feedback_db": tmp_path / "f.sqlite"}, clock)
        items = labels(clock.now, 60)
        for item in items:
            assert [r["status"] for r in service.record(SERVED, [item])] == ["recorded"]
            sqlite.record(SERVED, [item])
        assert [r["status"] for r in service.record(SERVED, [items[0]])] == ["duplicate"]
        (receipt, letter), (fresh, _) = items[0], labels(clock.now, 1, seed=1)[0]
        with pytest.raises(LabelConflict, match="already has another label"):
            service.record(SERVED, [(fresh, "B"), (receipt, "A" if letter != "A" else "B")], prefix="items.")
        assert len(store.since(0)) == 60 and service.conflicts == {"default": 1}  # the fresh label is not written
        assert reported(service) == reported(sqlite) and counts(service)[("answered_share", None)][0] == 60
        assert store.checkpoint == 60 and store.state(("default", "4", "answered_share", None)) is not None

        quota = LabelQuota("label_token", labels=2, window_s=60)
        with pytest.raises(TooLarge, match="3 new labels in one request"):
            service.record(SERVED, labels(clock.now, 3, seed=2), quota=quota)
        assert [r["status"] for r in service.record(SERVED, labels(clock.now, 2, seed=3), quota=quota)] == \
            ["recorded", "recorded"]
        clock.now += 20
        with pytest.raises(TooManyLabels) as e:
            service.record(SERVED, labels(clock.now, 1, seed=4), quota=quota)
        assert e.value.retry_after == 40 and len(store.since(0)) == 62

        reads = Reads(store)
        restarted = engine({}, clock, store=reads)
        assert reads.rows == 0 and reads.states > 0 and reported(restarted) == reported(service)
