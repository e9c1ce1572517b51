"""evaluate_run loads a run as it trained: in the dtype its config names, over the prefix cache when only its top
layers trained."""

import pytest
import torch

from ibedl.core.predictor import Predictor
from ibedl.core.prefix_cache import PrefixCachedTrunk
from ibedl.core.prompt import MCQuestion
from ibedl.training.experiments.evaluate_run import load_run, trained_dtype
from tests.conftest import train_tiny

QUESTIONS = [MCQuestion("What do plants need?", ("sunlight", "sand", "salt")),
             MCQuestion("Which is a bird?", ("stone", "sparrow", "river", "cloud"))]


@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                         ("float16", torch.float16)])
def test_a_run_evaluates_in_the_dtype_it_trained_in(name, dtype):
    assert trained_dtype({"config": {"dtype": name, "device": "cuda"}}) is dtype


@pytest.mark.parametrize("training", [None, {}, {"config": None}, {"config": {"dtype": None}}])
def test_no_dtype_named_leaves_the_devices_default(training):
    assert trained_dtype(training) is None


def test_load_run_loads_a_top_layer_run_in_its_dtype_over_the_prefix_cache(tiny_model_dir, tiny_jsonl, tmp_path):
    out = train_tiny(tiny_model_dir, tiny_jsonl, tmp_path, "method=map", "train_layers=1", "dtype=bfloat16")
    run = load_run(out)
    assert run.model.dtype == torch.bfloat16 and isinstance(run.trunk, PrefixCachedTrunk)
    full = Predictor.from_artifact(out, dtype=torch.bfloat16)  # the same run through the whole model
    for a, b in zip(run.predict(QUESTIONS), full.predict(QUESTIONS), strict=True):
        assert a.probs == pytest.approx(b.probs, abs=2e-2)


def test_load_run_of_a_whole_model_run_keeps_the_devices_default(tiny_map_artifact):
    run = load_run(tiny_map_artifact)
    assert run.model.dtype == torch.float32 and not isinstance(run.trunk, PrefixCachedTrunk)


def test_every_ib_edl_set_has_its_zeta_free_row_and_other_heads_none(tiny_artifact, tiny_map_artifact):
    from ibedl.training.evaluate import predict_all
    from ibedl.training.experiments.evaluate_run import outputs, zeta_free

    run = load_run(tiny_artifact)  # IB-EDL
    config = run.head.config
    assert config.posthoc_key == "zeta"
    config.zeta = 0.0  # the fit chose 0: the row is the predictions themselves
    preds = predict_all(run, QUESTIONS, progress=False)[0]
    assert zeta_free(run, QUESTIONS, outputs(preds), 2) == {"without_posthoc": outputs(preds)}
    config.zeta = -5.0  # a fitted zeta: predicted again at 0, the fitted value kept
    sharpened = predict_all(run, QUESTIONS, progress=False)[0]
    assert outputs(sharpened) != outputs(preds)
    assert zeta_free(run, QUESTIONS, outputs(sharpened), 2) == {"without_posthoc": outputs(preds)}
    assert config.zeta == -5.0
    softmax = load_run(tiny_map_artifact)
    assert zeta_free(softmax, QUESTIONS, outputs(predict_all(softmax, QUESTIONS, progress=False)[0]), 2) == {}
