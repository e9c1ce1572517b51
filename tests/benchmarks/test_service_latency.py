"""The service's own model time as benchmarks.service_latency reads it from the Prometheus text."""

import pytest

from benchmarks.service_latency import forward_seconds

METRICS = """# HELP ibedl_forward_seconds model time per batch
# TYPE ibedl_forward_seconds histogram
ibedl_forward_seconds_bucket{le="0.5"} 3.0
ibedl_forward_seconds_bucket{le="+Inf"} 4.0
ibedl_forward_seconds_count 4.0
ibedl_forward_seconds_sum 2.75
# HELP ibedl_forward_seconds_created model time per batch
ibedl_forward_seconds_created 1.7e9
ibedl_request_latency_seconds_sum{route="/predict"} 9.5
"""


def test_only_the_forward_sum_counts():
    assert forward_seconds(METRICS) == pytest.approx(2.75)


def test_series_of_several_labels_add_up_and_none_is_zero():
    labelled = 'ibedl_forward_seconds_sum{adapter="a"} 1.5\nibedl_forward_seconds_sum{adapter="b"} 0.25\n'
    assert forward_seconds(labelled) == pytest.approx(1.75)
    assert forward_seconds("# nothing measured yet\n") == 0.0


def test_the_paired_ratio_is_the_ratio_of_means_inside_its_interval():
    import numpy as np

    from benchmarks.service_latency import paired_ratio

    rng = np.random.default_rng(1)
    bare = rng.uniform(0.4, 0.6, 40)
    slower = paired_ratio(1.6 * bare + rng.normal(0, 0.01, 40), bare)
    assert slower["ratio"] == pytest.approx(1.6, abs=0.01) and slower["low"] < slower["ratio"] < slower["high"]
    assert slower["high"] - slower["low"] < 0.03  # pairs cancel the questions' own spread (unpaired: about 0.15)
    level = paired_ratio(bare + rng.normal(0, 0.05, 40), bare)
    assert level["low"] < 1.0 < level["high"]
    with pytest.raises(ValueError, match="paired times"):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match=r"1-D .* shapes \(2, 2\)"):  # a table of times is not a pairing
        paired_ratio([[1.0, 2.0], [3.0, 4.0]], [[1.0, 2.0], [3.0, 4.0]])
