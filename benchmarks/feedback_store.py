"""What a replica's start costs on a feedback store with a million labels, on SQLite and on PostgreSQL:

    python -m benchmarks.feedback_store [--labels 1000000] [--stores sqlite postgresql] [--tail 10000] \
        [--output benchmarks/results/feedback_store.json]

Per store, on a new database: ``--labels`` labels of one adapter version are bulk-inserted as the service stores
them (9 in 10 answered with a stated accuracy of 0.9, each with a 0.9 prediction set; right 92% of the time, the set
holding the answer 93%), in one transaction (SQLite ``executemany``, PostgreSQL ``COPY``). Then:

- *full replay*: a feedback engine (``ibedl.engine.feedback.Feedback``) binds to the store, which has no checkpoint
  yet, so it folds every label into the guarantees' confidence sequences, as every replica did at every start before
  checkpoints (and as the first replica on a store written before them does once); it writes the checkpoint as it
  goes;
- *ready*: ``--repeats`` new engines, each timed from its construction to bound (store opened, checkpoint's states
  loaded, the labels after them folded): the start of a replica now; they must report the full replay's bounds;
- *ready after a tail*: ``--tail`` more labels bulk-inserted after the checkpoint (labels no replica has folded yet),
  then one more start, which folds them.

The target is a replica ready within 10 s (a Kubernetes startup probe allows 5 minutes for the whole start, model
load included). PostgreSQL is the server at IBEDL_FEEDBACK_DSN when set (an empty database), else a temporary local
one started as the tests start it (``tests/postgres.py``: Debian's ``postgresql``, fsync off).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from benchmarks.common import cpu_features, write_result
from ibedl.engine.feedback import Feedback, open_store
from ibedl.engine.feedback_store import COLUMNS
from ibedl.engine.settings import EngineSettings

KEY = "benchmark-feedback-key-0123456789"
TARGET_S = 10.0
PROBS = json.dumps([0.05, 0.82, 0.1, 0.03])


def label_rows(n: int, start: int, seed: int, now: float) -> list[tuple]:
    """``n`` stored labels (tuples of :data:`COLUMNS`) of adapter ``default`` version 7, recorded over the last
    ``n`` seconds before ``now``."""
    rng = np.random.default_rng(seed)
    answered = rng.random(n) < 0.9
    right = rng.random(n) < 0.92
    covered = rng.random(n) < 0.93
    rows = []
    for i in range(n):
        a, r, c = bool(answered[i]), bool(right[i]), bool(covered[i])
        label = 1 if r else 2
        values = {"receipt_id": f"{start + i:032x}", "question": f"q-{start + i}", "adapter": "default", "version": "7",
                  "options": 4, "label": label, "predicted": 1, "answered": int(a), "target": 0.9 if a else None,
                  "covered": int(c), "coverage": 0.9, "adaptive_covered": None, "adaptive_coverage": None,
                  "probs": PROBS, "alpha": None, "issued": now - n + i - 1, "recorded": now - n + i,
                  "credential": "label_token", "calibration": "torch-fp32"}
        rows.append(tuple(values[c] for c in COLUMNS))
    return rows


def bulk_insert(settings: EngineSettings, rows: list[tuple]) -> float:
    """Seconds to insert ``rows`` in one transaction, the fastest way each database has."""
    start = time.perf_counter()
    if settings.feedback_dsn is not None:
        import psycopg

        with psycopg.connect(settings.feedback_dsn.get_secret_value()) as conn, conn.cursor() as cursor, \
                cursor.copy(f"COPY feedback ({', '.join(COLUMNS)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
    else:
        with sqlite3.connect(settings.feedback_db) as conn:
            conn.executemany(f"INSERT INTO feedback ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                             rows)
    return time.perf_counter() - start


def store_size(settings: EngineSettings) -> int:
    """Bytes the store takes on disk (SQLite: the file and its WAL; PostgreSQL: the database)."""
    if settings.feedback_dsn is not None:
        import psycopg

        with psycopg.connect(settings.feedback_dsn.get_secret_value()) as conn:
            return int(conn.execute("SELECT pg_database_size(current_database())").fetchone()[0])
    db = Path(settings.feedback_db)
    return sum(p.stat().st_size for p in db.parent.glob(db.name + "*"))


def start(settings: EngineSettings) -> tuple[float, Feedback]:
    """Seconds from constructing a feedback engine to bound (store open, states loaded, later labels folded)."""
    begin = time.perf_counter()
    feedback = Feedback(settings)
    feedback.bind({})
    return time.perf_counter() - begin, feedback


def run_store(settings: EngineSettings, labels: int, tail: int, repeats: int) -> dict:
    open_store(settings).close()  # the tables, as the service creates them
    now = time.time()
    insert_s = bulk_insert(settings, label_rows(labels, 0, seed=0, now=now))
    print(f"  {labels} labels inserted in {insert_s:.1f} s; full replay...", file=sys.stderr, flush=True)
    replay_s, replayed = start(settings)
    reference = replayed.guarantees({"default": "7"})
    print(f"  full replay {replay_s:.1f} s; starts from the checkpoint...", file=sys.stderr, flush=True)
    ready = []
    for _ in range(repeats):
        seconds, feedback = start(settings)
        assert feedback.guarantees({"default": "7"}) == reference, "a start from the checkpoint differs from the replay"
        ready.append(seconds)
        feedback.store.close()
    tail_insert_s = bulk_insert(settings, label_rows(tail, labels, seed=1, now=time.time()))
    tail_s, feedback = start(settings)
    share = next(g for g in feedback.guarantees({"default": "7"}) if g["guarantee"] == "answered_share")
    assert share["labels"] == labels + tail, share
    states = feedback.store.read(0, 1).states
    return {
        "labels": labels,
        "series": len(reference),
        "insert_s": round(insert_s, 2),
        "full_replay_s": round(replay_s, 2),
        "full_replay_us_per_label": round(replay_s / labels * 1e6, 1),
        "ready_s": {"median": round(statistics.median(ready), 4), "max": round(max(ready), 4),
                    "each": [round(s, 4) for s in ready]},
        "speedup_vs_full_replay": round(replay_s / statistics.median(ready)),
        "tail_labels": tail,
        "tail_insert_s": round(tail_insert_s, 2),
        "ready_after_tail_s": round(tail_s, 3),
        "checkpoint_state_bytes": sum(len(s) for s in states.values()),
        "store_bytes": store_size(settings),
        "within_target": max(ready) <= TARGET_S and tail_s <= TARGET_S,
        "guarantees": [{k: g[k] for k in ("guarantee", "stated", "labels", "hits", "lower", "upper")}
                       for g in reference],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.feedback_store", description=__doc__.split("\n\n")[0])
    parser.add_argument("--labels", type=int, default=1_000_000, help="labels in the store (default 1,000,000)")
    parser.add_argument("--stores", nargs="+", choices=("sqlite", "postgresql"), default=["sqlite", "postgresql"])
    parser.add_argument("--tail", type=int, default=10_000, help="labels recorded after the checkpoint, for the last "
                        "start (default 10,000)")
    parser.add_argument("--repeats", type=int, default=5, help="starts from the checkpoint timed (default 5)")
    parser.add_argument("--output", default="benchmarks/results/feedback_store.json")
    args = parser.parse_args(argv)
    if args.labels < 1 or args.tail < 1 or args.repeats < 1:
        parser.error(f"--labels, --tail and --repeats must be >= 1, got {args.labels}, {args.tail}, {args.repeats}")
    import psycopg

    given = argv if argv is not None else sys.argv[1:]
    result = {"command": " ".join(["python -m benchmarks.feedback_store", *given]),
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_features(),
              "python": platform.python_version(), "numpy": np.__version__, "sqlite": sqlite3.sqlite_version,
              "psycopg": psycopg.__version__, "target_ready_s": TARGET_S, "stores": {}}
    with tempfile.TemporaryDirectory(prefix="ibedl-bench-") as tmp:
        for kind in args.stores:
            print(f"{kind}:", file=sys.stderr, flush=True)
            if kind == "sqlite":
                settings = EngineSettings(feedback_key=KEY, feedback_db=Path(tmp) / "feedback.sqlite")
                result["stores"][kind] = run_store(settings, args.labels, args.tail, args.repeats)
                continue
            dsn = os.environ.get("IBEDL_FEEDBACK_DSN", "").strip()
            if dsn:
                result["postgresql"] = "the server at IBEDL_FEEDBACK_DSN"
                result["stores"][kind] = run_store(EngineSettings(feedback_key=KEY, feedback_dsn=dsn), args.labels,
                                                   args.tail, args.repeats)
                continue
            from tests.postgres import PostgresServer, postgres_bin

            with PostgresServer() as server:
                with psycopg.connect(server.dsn()) as conn:
                    version = conn.execute("SHOW server_version").fetchone()[0]
                binary = os.path.realpath(postgres_bin("postgres"))
                result["postgresql"] = f"a local server started for the run ({binary}, version {version}, fsync off)"
                settings = EngineSettings(feedback_key=KEY, feedback_dsn=server.create_database("feedback_bench"))
                result["stores"][kind] = run_store(settings, args.labels, args.tail, args.repeats)
    result["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    write_result(args.output, result)
    return 0 if all(s["within_target"] for s in result["stores"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
