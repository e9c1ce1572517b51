"""ibedl/engine/settings.py: the defaults computed from the machine, and values refused with the setting named."""

import os

import pytest
from pydantic import ValidationError

from ibedl.engine.settings import EngineSettings


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 1), (7, 1), (8, 2), (12, 3), (16, 4), (128, 4)])
def test_requests_are_checked_on_a_quarter_of_the_cores_one_to_four_by_default(monkeypatch, cores, threads):
    monkeypatch.delenv("IBEDL_CHECK_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert EngineSettings().check_threads == threads


def test_without_an_affinity_mask_the_default_counts_the_machine_s_cores(monkeypatch):
    monkeypatch.delenv("IBEDL_CHECK_THREADS", raising=False)
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    assert EngineSettings().check_threads == 3


def test_a_set_count_is_taken_as_it_is(monkeypatch):
    monkeypatch.setenv("IBEDL_CHECK_THREADS", "6")
    assert EngineSettings().check_threads == 6


@pytest.mark.parametrize("value", ["0", "65", "two"])
def test_a_count_out_of_range_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("IBEDL_CHECK_THREADS", value)
    with pytest.raises(ValidationError, match="check_threads"):
        EngineSettings()


@pytest.mark.parametrize("value, message", [
    ("bogus", "device 'bogus' is not cpu, cuda or cuda:<index>"),
    ("tpu", "device 'tpu' is not cpu, cuda or cuda:<index>"),
])
def test_a_device_that_is_none_is_refused_by_name(monkeypatch, value, message):
    monkeypatch.setenv("IBEDL_DEVICE", value)
    with pytest.raises(ValidationError, match=message):  # before a model is loaded, not torch's error after
        EngineSettings()


def test_a_cuda_device_is_refused_where_a_model_loads_not_in_the_settings(monkeypatch):
    """Settings a tool reads without loading a model (batch --feedback, evaluate's backend) take IBEDL_DEVICE=cuda
    on any machine; loading a model on it where torch sees no GPU is refused, naming it. Empty is unset."""
    import torch

    from ibedl.engine.runtime import load_predictors

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("IBEDL_DEVICE", "cuda:0")
    settings = EngineSettings()
    assert settings.device == "cuda:0"
    with pytest.raises(ValueError, match="device 'cuda:0': torch sees no CUDA GPU on this machine"):
        load_predictors(settings)
    monkeypatch.setenv("IBEDL_DEVICE", "")
    assert EngineSettings().device is None


def test_artifacts_that_name_no_directory_are_refused_not_read_as_unset(monkeypatch):
    monkeypatch.setenv("IBEDL_ARTIFACTS", ",,")  # it served artifacts/default, silently
    with pytest.raises(ValidationError, match="IBEDL_ARTIFACTS names no directory: ',,'"):
        EngineSettings()
    monkeypatch.setenv("IBEDL_ARTIFACTS", "")  # empty: unset, as compose's ${IBEDL_ARTIFACTS:-} gives it
    assert EngineSettings().served_artifacts() == [EngineSettings().artifact]
