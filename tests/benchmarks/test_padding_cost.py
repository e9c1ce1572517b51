"""benchmarks/padding_cost.py: the padded tokens of each way against a count by hand, and a real run on the default
adapter on this CPU (both ways alternate on the same batches and answer alike)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import padding_cost


def test_padded_tokens_count_each_length_groups_longest_prompt():
    # grouped at 1.25x: [10, 11] (22 padded for 21 real) and [40] alone; free: one forward of 3 x 40
    assert padding_cost.padded_tokens([40, 10, 11], 1.25) == (2, 22 + 40)
    assert padding_cost.padded_tokens([40, 10, 11], math.inf) == (1, 120)


@pytest.mark.parametrize("argv, message", [(["--batches", "1"], "--batches must be >= 2, got 1"),
                                           (["--batch-size", "0"], "--batch-size must be >= 1, got 0")])
def test_bad_counts_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        padding_cost.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.integration
def test_a_real_run_alternates_both_ways_on_the_same_batches(tmp_path, monkeypatch):
    from tests.conftest import shared_cache_dir

    monkeypatch.setenv("IBEDL_CACHE_DIR", shared_cache_dir())
    out = tmp_path / "p.json"
    assert padding_cost.main(["--batches", "2", "--batch-size", "3", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["questions"] == 6 and result["device"]["cores"] >= 1 and result["backend"] == "torch"
    assert result["free"]["forwards"] == 2 <= result["grouped"]["forwards"]  # one forward a batch when free
    assert result["free"]["padded_tokens"] >= result["grouped"]["padded_tokens"] >= result["real_tokens"]
    ratio = result["free_over_grouped_time"]
    assert ratio["ratio"] == pytest.approx(result["free"]["seconds"] / result["grouped"]["seconds"])
    assert result["largest_probability_difference"] < 1e-5  # right padding: the same answers either way

