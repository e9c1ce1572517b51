"""Warm start (``init_from``): a run begins from a trained artifact's LoRA weights and option rows."""

import json

import pytest
import torch
from safetensors.torch import load_file

from ibedl.core.artifact import read_manifest
from ibedl.core.predictor import Predictor
from ibedl.training.config import load_config
from ibedl.training.data import load_dataset
from ibedl.training.evaluate import evaluate
from ibedl.training.finetune import build, train
from ibedl.training.methods import get_method
from tests.training.test_finetune import config, jsonl_data  # noqa: F401 - the toy data fixture


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_model_dir, jsonl_data):  # noqa: F811
    """A trained MAP artifact on the tiny model (3 steps at lr 1e-2, so its LoRA B is far from 0)."""
    tmp = tmp_path_factory.mktemp("source")
    return train(config(tmp, tiny_model_dir, jsonl_data, "map", **{"optim.lr": 1e-2, "lora.dropout": 0.0}))


def lora_tensors(model) -> dict[str, torch.Tensor]:
    """PEFT parameter names without the adapter name, as in adapter_model.safetensors."""
    return {n.replace(".default", ""): p.detach() for n, p in model.named_parameters() if "lora_" in n}


def test_ib_edl_starts_from_the_map_adapter_and_its_rows(tmp_path, tiny_model_dir, jsonl_data, source):  # noqa: F811
    cfg = config(tmp_path, tiny_model_dir, jsonl_data, "ib_edl", init_from=str(source))
    predictor, _, _, _, warm = build(cfg, get_method("ib_edl"))
    saved = load_file(str(source / "adapter_model.safetensors"))
    ours = lora_tensors(predictor.model)
    assert set(ours) == set(saved) and warm["lora_tensors"] == len(saved)
    assert any(n.endswith("lora_B.weight") and v.abs().max() > 0 for n, v in saved.items())  # not PEFT's zero init
    for name, value in saved.items():
        assert torch.equal(ours[name], value), name
    rows = load_file(str(source / "head.safetensors"))["weight"]
    assert torch.equal(predictor.head.mu_weight.detach(), rows)
    assert torch.allclose(predictor.head.sigma_weight.detach(), rows * predictor.head.config.sigma_init_scale)
    assert warm == {"path": str(source), "name": "map", "version": "1", "method": "map", "lora_tensors": len(saved),
                    "head": "rows"}


def test_same_method_continues_exactly_where_the_source_stopped(tmp_path, tiny_model_dir, jsonl_data, source):  # noqa: F811
    cfg = config(tmp_path, tiny_model_dir, jsonl_data, "map", init_from=str(source))
    predictor, _, _, _, warm = build(cfg, get_method("map"))
    assert warm["head"] == "all"
    questions = load_dataset("jsonl", "validation", path=jsonl_data, limit=12)
    ours = evaluate(predictor.eval(), questions, progress=False)
    theirs = evaluate(Predictor.from_artifact(source), questions, progress=False)
    assert ours.metrics["nll"] == pytest.approx(theirs.metrics["nll"], abs=1e-6)
    fresh = evaluate(build(config(tmp_path / "f", tiny_model_dir, jsonl_data, "map"), get_method("map"))[0].eval(),
                     questions, progress=False)
    # the warm start is what made them equal
    assert fresh.metrics["nll"] != pytest.approx(theirs.metrics["nll"], abs=1e-3)


def test_warm_started_run_records_its_source(tmp_path, tiny_model_dir, jsonl_data, source):  # noqa: F811
    out = train(config(tmp_path, tiny_model_dir, jsonl_data, "ib_edl", init_from=str(source),
                       **{"method_params.num_samples": 4}))
    manifest = read_manifest(out)
    assert manifest.training["init_from"]["method"] == "map"
    assert manifest.training["config"]["init_from"] == str(source)
    assert json.loads((out / "manifest.json").read_text())["training"]["init_from"]["head"] == "rows"
    # The artifact stands alone: it loads and predicts without the source.
    assert Predictor.from_artifact(out).manifest.method == "ib_edl"


def test_a_different_lora_shape_is_refused(tmp_path, tiny_model_dir, jsonl_data, source):  # noqa: F811
    cfg = config(tmp_path, tiny_model_dir, jsonl_data, "ib_edl", init_from=str(source), **{"lora.r": 4})
    with pytest.raises(ValueError, match=r"its LoRA \(r, alpha, targets\) = \(8, 16, .*this run's = \(4, 16"):
        build(cfg, get_method("ib_edl"))


def test_init_from_must_be_an_artifact(tmp_path, jsonl_data):  # noqa: F811
    with pytest.raises(ValueError,
                       match=f"init_from must be an artifact directory with a manifest.json, got '{tmp_path}'"):
        load_config(None, ["method=map", f"output={tmp_path / 'o'}", f"init_from={tmp_path}",
                           f"data={{train: [{{dataset: jsonl, path: {jsonl_data}}}], "
                           f"validation: [{{dataset: jsonl, path: {jsonl_data}}}]}}"])


def test_an_ensemble_cannot_seed_one_adapter(tmp_path, tiny_model_dir, jsonl_data):  # noqa: F811
    ensemble = train(config(tmp_path / "e", tiny_model_dir, jsonl_data, "ensemble", **{"method_params.members": 2}))
    cfg = config(tmp_path, tiny_model_dir, jsonl_data, "map", init_from=str(ensemble))
    with pytest.raises(ValueError, match=r"an ensemble \(2 members\) cannot seed one adapter"):
        build(cfg, get_method("map"))
