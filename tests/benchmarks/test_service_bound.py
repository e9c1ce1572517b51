"""benchmarks/service_bound.py: a real run of the HTTP service on the tiny adapter around the stand-in trunk, its
client in a process of its own, and its arguments refused by name."""

from __future__ import annotations

import json

import pytest

from benchmarks import service_bound


@pytest.mark.parametrize("argv, message", [
    (["--clients", "0"], "--clients must be >= 1, got 0"),
    (["--requests", "0"], "--requests must be >= 1, got 0"),
    (["--check-threads", "0"], "--check-threads must be >= 1, got 0"),
    (["--items", "0"], "--items must be >= 1, got 0"),
])
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        service_bound.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("items", "freeze"), [(1, False), (3, True)])
def test_a_real_run_answers_every_request_over_http_and_splits_the_service_s_cpu_by_thread(tiny_artifact, tmp_path,
                                                                                           monkeypatch, items, freeze):
    import gc
    import logging

    from ibedl.core.predictor import Predictor

    forwards = []
    monkeypatch.setattr(Predictor, "_hidden", lambda self, batch: forwards.append(batch))  # must not run
    out = tmp_path / "s.json"
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # recorded as the run had it (torch has read it long before)
    handlers = logging.getLogger().handlers[:]
    gc.unfreeze()
    try:
        assert service_bound.main(["--artifact", str(tiny_artifact), "--clients", "3", "--requests", "12", "--items",
                                   str(items), "--check-threads", "2", "--dataset", "obqa", "--output", str(out),
                                   "--gc-freeze" if freeze else "--no-gc-freeze"]) == 0
        assert (gc.get_freeze_count() > 0) == freeze  # the service froze its start, or not
    finally:
        gc.unfreeze()
    assert logging.getLogger().handlers == handlers  # the service's log configuration is undone
    assert forwards == []  # the stand-in answered every pass
    result = json.loads(out.read_text())
    assert result["statuses"] == {"200": 12} and result["check_threads"] == 2 and result["cpu"]["cores"] >= 1
    assert result["items_per_request"] == items and result["gc_freeze"] is freeze
    assert (result["frozen_objects"] > 0) == freeze and result["omp_wait_policy"] == "PASSIVE"
    collections = result["gc_collections"]
    assert set(collections) == {"0", "1", "2"} and collections["0"]["collections"] > 0  # the timed requests' own
    assert result["answers_per_s"] > 0 and 0 < result["latency_ms"]["p50"] <= result["latency_ms"]["p99"]
    by_thread = result["cpu_ms_per_answer_by_thread"]
    assert {"event_loop", "check", "model"} <= set(by_thread) and all(v >= 0 for v in by_thread.values())
    assert all(role in {"event_loop", "check", "model"} or role.startswith("other: ") for role in by_thread)
    assert result["client_cpu_ms_per_request"] > 0
    bounds = {k: v for k, v in result["bound_answers_per_s_by_thread"].items() if v is not None}  # a short run:
    if bounds:  # a thread may have used less than a clock tick
        assert result["bound_answers_per_s"] == min(bounds.values()) and bounds[result["bound_by"]] == min(
            bounds.values())
    else:
        assert result["bound_answers_per_s"] is None and result["bound_by"] is None


def test_the_percentile_interpolates_and_takes_a_single_value():
    assert service_bound.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert service_bound.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert service_bound.percentile([7.0], 99) == 7.0


def test_collections_are_counted_by_generation_only_inside_the_block():
    import gc

    with service_bound.Collections() as collections:
        gc.collect(2)
        gc.collect(0)
    gc.collect(2)  # after the block: not counted
    summary = collections.summary()
    assert summary["2"]["collections"] == 1 and summary["0"]["collections"] >= 1
    assert summary["2"]["longest_ms"] == pytest.approx(1e3 * summary["2"]["seconds"])
