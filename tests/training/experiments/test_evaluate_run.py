"""evaluate_run's choice of arithmetic: a run evaluates in the dtype its training config names."""

import pytest
import torch

from ibedl.training.experiments.evaluate_run import trained_dtype


@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                         ("float16", torch.float16)])
def test_a_run_evaluates_in_the_dtype_it_trained_in(name, dtype):
    assert trained_dtype({"config": {"dtype": name, "device": "cuda"}}) is dtype


@pytest.mark.parametrize("training", [None, {}, {"config": None}, {"config": {"dtype": None}}])
def test_no_dtype_named_leaves_the_devices_default(training):
    assert trained_dtype(training) is None
