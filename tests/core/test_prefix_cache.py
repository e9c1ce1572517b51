"""The prefix-cached trunk on the tiny model: it equals the full forward, caches per prompt, recovers from torn
files, keys the cache by the frozen layers' weights; training with train_layers freezes the layers below."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from ibedl.core import prefix_cache
from ibedl.core.base_model import load_base_model, resolve_model
from ibedl.core.head import HeadConfig, build_head
from ibedl.core.predictor import Predictor, lm_head_rows
from ibedl.core.prefix_cache import PrefixCachedTrunk, check_train_layers, freeze_below, layer_index
from ibedl.core.prompt import MCQuestion, option_token_ids
from tests.conftest import train_tiny

QUESTIONS = [
    MCQuestion("What do plants need?", ("sunlight", "sand", "salt", "iron")),
    MCQuestion("Which planet is closest to the sun?", ("Mercury", "Venus", "Earth")),
    MCQuestion("Read the passage. What did the boy buy?", ("apples", "bread", "milk", "eggs", "rice"),
               context="The boy went to the market to buy apples and bread for his mother. " * 3),
]


@pytest.fixture
def predictor(tiny_model_dir):
    resolved = resolve_model(tiny_model_dir)
    model, tok = load_base_model(resolved, device="cpu")
    ids = option_token_ids(tok, 26)
    head = build_head(HeadConfig("ib_edl", 26, model.config.hidden_size), lm_head_rows(model, ids))
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             init_lora_weights=False))
    model.eval()
    return Predictor(model, tok, head, template="plain-v1", max_tokens=256), resolved.sha256


def files(root):
    return sorted(root.rglob("*.safetensors"))


def test_split_forward_equals_full_forward_and_caches_each_prompt(predictor, tmp_path, monkeypatch):
    p, sha = predictor
    enc = p.encode(QUESTIONS)
    with torch.no_grad():
        full = p.hidden(enc)
        trunk = PrefixCachedTrunk(p, 1, sha, root=tmp_path)
        split = trunk(enc)
    torch.testing.assert_close(split, full, rtol=1e-5, atol=1e-5)
    assert len(files(tmp_path)) == len(QUESTIONS)
    monkeypatch.setattr(trunk, "_compute", lambda *a: pytest.fail("a cached prompt was computed again"))
    with torch.no_grad():
        torch.testing.assert_close(trunk(enc), full, rtol=1e-5, atol=1e-5)


def test_torn_cache_file_is_recomputed(predictor, tmp_path):
    p, sha = predictor
    enc = p.encode(QUESTIONS[:1])
    trunk = PrefixCachedTrunk(p, 1, sha, root=tmp_path)
    with torch.no_grad():
        first = trunk(enc)
        (path,) = files(tmp_path)
        path.write_bytes(b"torn")
        torch.testing.assert_close(trunk(enc), first)
    assert path.stat().st_size > 100


def test_cache_is_keyed_by_the_frozen_layers_weights(predictor, tmp_path):
    p, sha = predictor
    trunk = PrefixCachedTrunk(p, 1, sha, root=tmp_path)
    before = trunk.digest()
    top = [param for name, param in p.model.named_parameters() if "lora_" in name and layer_index(name) == 1][0]
    with torch.no_grad():
        top.add_(1.0)  # a live layer: same cache
    assert PrefixCachedTrunk(p, 1, sha, root=tmp_path).digest() == before
    bottom = [param for name, param in p.model.named_parameters() if "lora_" in name and layer_index(name) == 0][0]
    with torch.no_grad():
        bottom.add_(1.0)  # a cached layer: another cache
    assert PrefixCachedTrunk(p, 1, sha, root=tmp_path).digest() != before
    assert PrefixCachedTrunk(p, 1, "another-base", root=tmp_path).digest() != before


def test_ensemble_members_with_the_same_frozen_weights_share_the_cache(predictor, tmp_path):
    p, sha = predictor
    before = PrefixCachedTrunk(p, 1, sha, root=tmp_path).digest()
    p.model.add_adapter("m1", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                         init_lora_weights=False))
    params = dict(p.model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if ".m1." in name:
                param.copy_(params[name.replace(".m1.", ".default.")])
    p.model.set_adapter("m1")
    member = PrefixCachedTrunk(p, 1, sha, root=tmp_path)
    assert member.digest() == before  # a member named m1 with the default's weights reads the default's cache
    with torch.no_grad():
        next(param for name, param in params.items() if ".m1." in name and layer_index(name) == 0).add_(1.0)
    assert PrefixCachedTrunk(p, 1, sha, root=tmp_path).digest() != before
    p.model.set_adapter("default")
    assert PrefixCachedTrunk(p, 1, sha, root=tmp_path).digest() == before


def test_layer_helpers_and_bad_values(predictor):
    p, _ = predictor
    assert layer_index("base_model.model.model.layers.12.self_attn.q_proj.lora_A.default.weight") == 12
    assert layer_index("base_model.model.lm_head.weight") is None
    assert check_train_layers(p.model, 1) == 1
    for bad in (0, 3):
        with pytest.raises(ValueError, match=f"train_layers must be in 1..2 .*got {bad}"):
            check_train_layers(p.model, bad)
    with pytest.raises(ValueError, match="first live layer must be in 1..1, got 0"):
        PrefixCachedTrunk(p, 0, "x")
    frozen = freeze_below(p.model, 1)
    grads = {name: param.requires_grad for name, param in p.model.named_parameters() if "lora_" in name}
    assert frozen == 4 and all(g == (layer_index(n) == 1) for n, g in grads.items())


def test_train_layers_trains_the_top_layers_only(tiny_model_dir, tiny_jsonl, tmp_path):
    out = train_tiny(tiny_model_dir, tiny_jsonl, tmp_path, "method=ib_edl", "method_params.num_samples=2",
                     "train_layers=1")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["training"]["config"]["train_layers"] == 1
    from safetensors.torch import load_file

    weights = load_file(out / "adapter_model.safetensors")
    b = {name: t for name, t in weights.items() if "lora_B" in name}
    assert b and all(bool(t.abs().max() == 0) == (layer_index(name) == 0) for name, t in b.items())  # B starts at 0
    # The artifact is an ordinary adapter: the full forward and the prefix-cached one agree.
    loaded = Predictor.from_artifact(out)
    full = loaded.predict(QUESTIONS)
    prefix_cache.attach(loaded, 1, manifest["base_model"]["sha256"])
    assert isinstance(loaded.trunk, PrefixCachedTrunk)
    for a, c in zip(full, loaded.predict(QUESTIONS), strict=True):
        assert a.probs == pytest.approx(c.probs, abs=1e-5)
    assert prefix_cache.attach(loaded, 2, "x") is None  # all layers trained: nothing to cache


@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_config_rejects_bad_train_layers(value):
    from ibedl.training.config import load_config

    with pytest.raises(ValueError, match="train_layers must be a positive number"):
        load_config(None, ["output=x", "method=map", f"train_layers={json.dumps(value)}",
                           "data={train: [{dataset: sciq}], validation: [{dataset: sciq}]}"])


def test_bf16_model_splits_at_its_own_dtype(tiny_model_dir, tmp_path):
    """The cache holds float32 states; a bf16 model (the CUDA default) reads them back in bf16, the probe too."""
    resolved = resolve_model(tiny_model_dir)
    model, tok = load_base_model(resolved, device="cpu", dtype=torch.bfloat16)
    head = build_head(HeadConfig("evidential", 26, model.config.hidden_size),
                      lm_head_rows(model, option_token_ids(tok, 26)))
    p = Predictor(model, tok, head, template="plain-v1", max_tokens=256)
    enc = p.encode(QUESTIONS)
    with torch.no_grad():
        full = p.hidden(enc)
        trunk = PrefixCachedTrunk(p, 1, resolved.sha256, root=tmp_path)  # runs the probe
        split = trunk(enc)
    assert split.dtype == full.dtype == torch.bfloat16
    torch.testing.assert_close(split, full, rtol=2e-2, atol=2e-2)
