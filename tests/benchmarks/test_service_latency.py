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
