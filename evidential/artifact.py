"""A trained adapter directory: PEFT adapter files, the head's safetensors and ``manifest.json``.

Layout::

    manifest.json                 what this adapter is (see Manifest)
    head.safetensors              option head tensors      } one set at the top, or one set per
    adapter_config.json           PEFT LoRA config         } ensemble member under members/<i>/
    adapter_model.safetensors     PEFT LoRA weights        } (the manifest's ``members``)

Loading reads JSON and safetensors only; nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from safetensors.torch import load_file, save_file

from evidential.conformal import alpha_key
from evidential.head import HeadConfig, OptionHead, build_head

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
HEAD_FILE = "head.safetensors"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class ArtifactError(ValueError):
    """An artifact directory that is missing files or holds an invalid manifest."""


OOD_SCORES = ("inverse_uncertainty", "max_probability")


@dataclass
class Abstention:
    """Default abstention rule, checked in this order:

    1. out of distribution: the question's OOD score (``ood_score``: 1/u for Dirichlet methods, max p for
       the others) is below ``ood_threshold`` (0 disables the gate);
    2. u > max_uncertainty;
    3. max p < min_confidence.

    ``how`` records how they were chosen (training.calibrate: the gate's rejection rate, the risk-control
    target, delta and bound).
    """

    max_uncertainty: float = 1.0
    min_confidence: float = 0.0
    ood_score: str | None = None
    ood_threshold: float = 0.0
    how: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("max_uncertainty", "min_confidence"):
            value = getattr(self, name)
            if isinstance(value, bool) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        if self.ood_score is not None and self.ood_score not in OOD_SCORES:
            raise ValueError(f"ood_score must be one of {OOD_SCORES} or null, got {self.ood_score!r}")
        if isinstance(self.ood_threshold, bool) or not 0.0 <= self.ood_threshold < float("inf"):
            raise ValueError(f"ood_threshold must be a finite number >= 0, got {self.ood_threshold!r}")


@dataclass
class Conformal:
    """Split-conformal quantiles (evidential.conformal) stored at calibration: ``quantiles[score][alpha]``,
    None where the calibration sample was too small for that alpha (every option is then in the set).
    ``alpha`` and ``score`` are what a response uses unless the request asks for another stored pair."""

    alpha: float
    score: str
    quantiles: dict
    n: int

    def __post_init__(self) -> None:
        if self.score not in self.quantiles:
            raise ValueError(f"conformal score {self.score!r} has no stored quantiles ({sorted(self.quantiles)})")
        if alpha_key(self.alpha) not in self.quantiles[self.score]:
            raise ValueError(f"conformal alpha {self.alpha} has no stored quantile for {self.score!r}")
        if self.n < 1:
            raise ValueError(f"conformal n must be >= 1, got {self.n}")

    def quantile(self, alpha: float | None = None, score: str | None = None) -> float:
        """The stored quantile of (alpha, score), defaults where None; KeyError names what is stored."""
        alpha = self.alpha if alpha is None else alpha
        score = self.score if score is None else score
        stored = self.quantiles.get(score, {})
        key = alpha_key(alpha)
        if key not in stored:
            raise KeyError(f"no conformal quantile for alpha {alpha} and score {score!r}; stored: "
                           f"{ {s: sorted(map(float, q)) for s, q in self.quantiles.items()} }")
        q = stored[key]
        return float("inf") if q is None else float(q)

    def alphas(self) -> list[float]:
        return sorted({float(a) for q in self.quantiles.values() for a in q})


@dataclass(frozen=True)
class BaseModelRef:
    """The manifest's ``base_model``: the base weights an adapter was trained on.

    Attributes:
        name: the base model's name.
        sha256: of its source weights; loading refuses other weights unless told to allow a mismatch.
        ref: what evidential.base_model.resolve_model finds it by (the name in manifests without one).
    """

    name: str
    sha256: str
    ref: str

    @classmethod
    def from_dict(cls, data: dict) -> BaseModelRef:
        for key in ("name", "sha256"):
            if key not in data:
                raise ArtifactError(f"manifest base_model needs {key!r}, got {data}")
        return cls(name=data["name"], sha256=data["sha256"], ref=data.get("ref", data["name"]))


@dataclass(frozen=True)
class PromptConfig:
    """The manifest's ``prompt``: the template the adapter was trained with and the training token cut
    (None in manifests that do not record it)."""

    template: str
    max_tokens: int | None = None

    @classmethod
    def from_dict(cls, data: dict) -> PromptConfig:
        if "template" not in data:
            raise ArtifactError(f"manifest prompt needs 'template', got {data}")
        return cls(template=data["template"], max_tokens=data.get("max_tokens"))


@dataclass
class Manifest:
    """Everything needed to serve and to trust an adapter, besides its tensors.

    Attributes:
        name, version: how the service names the adapter.
        method: registry key of the training method (``map``, ``edl``, ``ib_edl``, ...).
        method_config: the method's hyper-parameters (beta, K, ...).
        base_model: ``{"name", "sha256", "ref"}`` of the base weights the adapter was trained on (a
            :class:`BaseModelRef` as a dict).
        head: a :class:`HeadConfig` as a dict.
        option_token_ids: tokenizer ids of " A", " B", ... used to initialise the head rows.
        prompt: ``{"template", "max_tokens"}`` (a :class:`PromptConfig` as a dict).
        members: adapter sub-directories ("." for a single adapter; members/<i> for an ensemble).
        mc_samples: forward passes with dropout on at inference (MC-Dropout), 0 for none.
        training: data, sizes, seeds, steps, the command that produced the artifact.
        metrics: ``{"validation": {...}, "test": {...}}``.
        abstention: default thresholds and how they were chosen (an :class:`Abstention` as a dict).
        conformal: a :class:`Conformal` as a dict, or empty when the adapter was never calibrated.
        calibration: what training.calibrate did (data, post-hoc fit, gate, risk control), or empty.
        reference: ``{"uncertainty": [...], "confidence": [...], "split"}`` for drift monitoring.
    """

    method: str
    base_model: dict
    head: dict
    option_token_ids: list[int]
    prompt: dict
    name: str = "adapter"
    version: str = "0"
    method_config: dict = field(default_factory=dict)
    members: list[str] = field(default_factory=lambda: ["."])
    mc_samples: int = 0
    training: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    abstention: dict = field(default_factory=lambda: asdict(Abstention()))
    conformal: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)
    reference: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise ArtifactError(f"manifest schema_version {self.schema_version} is not {SCHEMA_VERSION}")
        self.base_model_ref()  # validates
        self.prompt_config()  # validates
        head = self.head_config()  # validates
        try:
            Abstention(**self.abstention)
            self.conformal_sets()
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"invalid abstention or conformal section in manifest: {e}") from e
        if len(self.option_token_ids) != head.num_rows:
            raise ArtifactError(
                f"{len(self.option_token_ids)} option_token_ids for a head of {head.num_rows} rows"
            )
        if not self.members:
            raise ArtifactError("manifest members must name at least one adapter directory")
        if self.mc_samples < 0:
            raise ArtifactError(f"mc_samples must be >= 0, got {self.mc_samples}")

    def base_model_ref(self) -> BaseModelRef:
        return BaseModelRef.from_dict(self.base_model)

    def prompt_config(self) -> PromptConfig:
        return PromptConfig.from_dict(self.prompt)

    def head_config(self) -> HeadConfig:
        try:
            return HeadConfig.from_dict(self.head)
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"invalid head config in manifest: {e}") from e

    def thresholds(self) -> Abstention:
        return Abstention(**self.abstention)

    def conformal_sets(self) -> Conformal | None:
        return Conformal(**self.conformal) if self.conformal else None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ArtifactError(f"manifest has unknown keys {unknown}")
        try:
            return cls(**data)
        except TypeError as e:
            raise ArtifactError(f"invalid manifest: {e}") from e


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: readers see the old or the new file, never half."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_manifest(directory: str | Path, manifest: Manifest) -> Path:
    path = Path(directory) / MANIFEST
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(manifest.to_dict(), indent=2, sort_keys=False) + "\n")
    return path


def read_manifest(directory: str | Path) -> Manifest:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{path} not found: is {directory} an adapter directory?")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: expected a JSON object")
    return Manifest.from_dict(data)


def save_head(directory: str | Path, head: OptionHead, state_dict: dict | None = None) -> Path:
    """The head's tensors as float32 safetensors; ``state_dict`` (default the head's own) is what a sharded
    training run gathered for it."""
    path = Path(directory) / HEAD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    state = head.state_dict() if state_dict is None else state_dict
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in state.items()}
    save_file(tensors, str(path))
    return path


def load_head(directory: str | Path, manifest: Manifest) -> OptionHead:
    path = Path(directory) / HEAD_FILE
    if not path.is_file():
        raise ArtifactError(f"{path} not found")
    head = build_head(manifest.head_config())
    tensors = load_file(str(path))
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ArtifactError(f"{path}: missing tensors {missing}, unexpected tensors {unexpected}")
    return head


def check_artifact(directory: str | Path) -> Manifest:
    """Read the manifest and check every file it implies exists. Returns the manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for member in manifest.members:
        for name in (*ADAPTER_FILES, HEAD_FILE):
            if not (directory / member / name).is_file():
                raise ArtifactError(f"{directory / member / name} not found")
    return manifest
