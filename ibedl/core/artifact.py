"""A trained adapter directory: PEFT adapter files, the head's safetensors and ``manifest.json``.

Layout::

    manifest.json                 what this adapter is (see Manifest; JSON Schema: ibedl.core.manifest_schema)
    README.md                     model card generated from the manifest (ibedl.core.model_card)
    head.safetensors              option head tensors      } one set at the top, or one set per
    adapter_config.json           PEFT LoRA config         } ensemble member under members/<i>/
    adapter_model.safetensors     PEFT LoRA weights        } (the manifest's ``members``)
    quantization_sample.jsonl     questions openvino-int8 is quantised on (ibedl.core.quantization_sample), if any

Loading reads JSON and safetensors only; nothing is unpickled, and nothing outside the directory: ``members`` are
relative paths inside it (no ``..``, not absolute, no symlink that leads out). Serving checks every weight file
against the sha256 the manifest's ``files`` records, and refuses a manifest that records none. A manifest of an
older ``schema_version`` is migrated when read (:func:`migrate`, the one place that knows the format's history);
``python -m ibedl.core.migrate DIR`` writes it back in the current version.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Literal, get_args

from safetensors.torch import load_file, save_file

from ibedl.core.base_model import portable_ref, sha256_file
from ibedl.core.conformal import ConformalScore, alpha_key
from ibedl.core.head import POSTHOC_NEUTRAL, HeadConfig, OptionHead, build_head
from ibedl.core.prompt import MAX_OPTIONS, MIN_OPTIONS

log = logging.getLogger(__name__)

SCHEMA_VERSION = 3
MIGRATE_COMMAND = "python -m ibedl.core.migrate"
MANIFEST = "manifest.json"
HEAD_FILE = "head.safetensors"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
WEIGHT_FILES = (ADAPTER_FILES[1], HEAD_FILE)  # what the manifest's ``files`` records the sha256 of
# adapter_config.json's task_type: the adapter sits on a causal LM's trunk, so PeftModel.from_pretrained on the
# loaded base builds a PeftModelForCausalLM (AutoPeftModelForCausalLM cannot: a known model's name is not a Hub
# repo); the option head is this package's, beside it.
PEFT_TASK_TYPE = "CAUSAL_LM"


class ArtifactError(ValueError):
    """An artifact directory that is missing files or holds an invalid manifest."""


OodScore = Literal["inverse_uncertainty", "max_probability"]
OOD_SCORES = get_args(OodScore)


@dataclass
class Abstention:
    """Default abstention rule, checked in this order:

    1. out of distribution: the question's OOD score (``ood_score``: 1/u for Dirichlet methods, max p for
       the others) is below ``ood_threshold`` (0 disables the gate);
    2. u > max_uncertainty;
    3. max p < min_confidence.

    ``how`` records how they were chosen (ibedl.training.calibrate: the gate's rejection rate, the risk-control
    target, delta and bound).

    Attributes:
        max_uncertainty: abstain when the uncertainty mass u exceeds it, in [0, 1] (1: never).
        min_confidence: abstain when the top probability is below it, in [0, 1].
        ood_score: the out-of-distribution score of the gate, or null for no gate.
        ood_threshold: abstain as out of distribution below this score, >= 0 (0: no gate).
        how: how the thresholds were chosen: rule, guarantee, target, delta, bound, coverage, n.
        by_options: option count (as a string) -> its own ``ood_threshold``, ``min_confidence`` and ``how``, when
            the calibration was made per option count (the top-level values are then the most common count's);
            empty: one calibration for every count.
    """

    max_uncertainty: float = 1.0
    min_confidence: float = 0.0
    ood_score: OodScore | None = None
    ood_threshold: float = 0.0
    how: dict = field(default_factory=dict)
    by_options: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("max_uncertainty", "min_confidence"):
            value = getattr(self, name)
            if isinstance(value, bool) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        if self.ood_score is not None and self.ood_score not in OOD_SCORES:
            raise ValueError(f"ood_score must be one of {OOD_SCORES} or null, got {self.ood_score!r}")
        if isinstance(self.ood_threshold, bool) or not 0.0 <= self.ood_threshold < float("inf"):
            raise ValueError(f"ood_threshold must be a finite number >= 0, got {self.ood_threshold!r}")
        for count, entry in self.by_options.items():
            _check_count(count)
            unknown = sorted(set(entry) - {"ood_threshold", "min_confidence", "how"})
            if unknown:
                raise ValueError(f"abstention by_options[{count}] sets only ood_threshold, min_confidence and how, "
                                 f"got {unknown}")
            Abstention(self.max_uncertainty, entry.get("min_confidence", 0.0), self.ood_score,
                       entry.get("ood_threshold", 0.0), entry.get("how", {}))

    @property
    def stated_target(self) -> float | None:
        """The answered accuracy these thresholds promise: ``how``'s target where the calibration certified it, else
        None (a target it could not certify is promised by no answer, receipt or gauge)."""
        return self.how.get("target_accuracy") if self.how.get("certified") else None

    def for_options(self, options: int) -> Abstention:
        """The thresholds of questions with ``options`` options: their own when calibrated per count, else these."""
        entry = self.by_options.get(str(options))
        if entry is None:
            return self
        return Abstention(self.max_uncertainty, entry["min_confidence"], self.ood_score, entry["ood_threshold"],
                          entry.get("how", {}))


def _check_count(count: str) -> int:
    """An option count written as a JSON key ("2".."26"); ValueError naming a bad one."""
    if not (isinstance(count, str) and count.isdigit() and MIN_OPTIONS <= int(count) <= MAX_OPTIONS):
        raise ValueError(f"by_options keys are option counts {MIN_OPTIONS}..{MAX_OPTIONS} as strings, got {count!r}")
    return int(count)


@dataclass
class Conformal:
    """Split-conformal quantiles (ibedl.core.conformal) stored at calibration: ``quantiles[score][alpha]``,
    None where the calibration sample was too small for that alpha (every option is then in the set).
    ``alpha`` and ``score`` are what a response uses unless the request asks for another stored pair.

    Attributes:
        alpha: default miscoverage of served prediction sets (one of the stored alphas).
        score: default conformal score.
        quantiles: score -> alpha (as a string, e.g. "0.1") -> quantile, or null where the calibration
            sample was too small for that alpha.
        n: calibration questions the quantiles rest on.
        delta: training-conditional (PAC) quantiles: with probability >= 1 - delta over the calibration draw, the
            served sets' coverage is >= 1 - alpha; null: marginal quantiles (coverage >= 1 - alpha on average over
            calibration draws; calibrations made before delta was recorded).
    """

    alpha: float
    score: ConformalScore
    quantiles: dict[str, dict[str, float | None]]
    n: int
    delta: float | None = None
    by_options: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.score not in self.quantiles:
            raise ValueError(f"conformal score {self.score!r} has no stored quantiles ({sorted(self.quantiles)})")
        if alpha_key(self.alpha) not in self.quantiles[self.score]:
            raise ValueError(f"conformal alpha {self.alpha} has no stored quantile for {self.score!r}")
        if self.n < 1:
            raise ValueError(f"conformal n must be >= 1, got {self.n}")
        if self.delta is not None and (isinstance(self.delta, bool) or not 0.0 < self.delta < 1.0):
            raise ValueError(f"conformal delta must be in (0, 1) or null (marginal), got {self.delta!r}")
        for count, entry in self.by_options.items():
            _check_count(count)
            if set(entry) != {"quantiles", "n"}:
                raise ValueError(f"conformal by_options[{count}] holds quantiles and n, got {sorted(entry)}")
            Conformal(self.alpha, self.score, entry["quantiles"], entry["n"], self.delta)

    def for_options(self, options: int) -> Conformal:
        """The quantiles of questions with ``options`` options: their own when calibrated per count, else these."""
        entry = self.by_options.get(str(options))
        return self if entry is None else Conformal(self.alpha, self.score, entry["quantiles"], entry["n"], self.delta)

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
        ref: what ibedl.core.base_model.resolve_model finds it by on any machine: a known name or a Hugging
            Face Hub repo id (ibedl.core.base_model.portable_ref), or a path the user gave.
    """

    name: str
    sha256: str
    ref: str

    @classmethod
    def from_dict(cls, data: dict) -> BaseModelRef:
        return _section(cls, "base_model", data)


@dataclass(frozen=True)
class PromptConfig:
    """The manifest's ``prompt``.

    Attributes:
        template: the prompt template the adapter was trained with (ibedl.core.prompt).
        max_tokens: the training token cut of a formatted prompt (null where not recorded).
    """

    template: str
    max_tokens: int | None = None

    @classmethod
    def from_dict(cls, data: dict) -> PromptConfig:
        return _section(cls, "prompt", data)


@dataclass
class BackendCalibration:
    """One calibration made on another backend than the manifest's top-level one (``calibrated_on``): the same
    sections, computed by ibedl.training.calibrate from the model's raw outputs on that backend and precision.

    Attributes:
        head: the head's post-hoc parameter fitted on this backend (``zeta`` or ``temperature``; empty: neutral).
        abstention: the thresholds served on this backend and how they were chosen.
        conformal: split-conformal quantiles of this backend's outputs, or empty.
        calibration: what ibedl.training.calibrate did (data, post-hoc fit, gate, risk control, command).
        reference: ``uncertainty`` and ``confidence`` samples of this backend's outputs, for drift monitoring.
        metrics: split name -> metrics of this backend's calibrated outputs (``--evaluate-split``).
    """

    head: dict = field(default_factory=dict)
    abstention: dict = field(default_factory=lambda: asdict(Abstention()), metadata={"section": Abstention})
    conformal: dict = field(default_factory=dict, metadata={"section": Conformal, "may_be_empty": True})
    calibration: dict = field(default_factory=dict)
    reference: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.head) - set(POSTHOC_NEUTRAL))
        if unknown:
            raise ValueError(f"a backend calibration's head sets only {sorted(POSTHOC_NEUTRAL)}, got {unknown}")
        Abstention(**self.abstention)
        if self.conformal:
            Conformal(**self.conformal)


@dataclass(frozen=True)
class ServedCalibration:
    """The calibration a predictor on one backend serves with (:meth:`Manifest.calibration_for`).

    Attributes:
        key: the backend and precision it was made on (``torch-fp32``, ``openvino-bf16``, ...).
        head: the head's post-hoc parameter it fitted (``zeta`` or ``temperature``).
        thresholds: the abstention thresholds.
        conformal: the stored conformal quantiles, or None (never calibrated).
        record: what ibedl.training.calibrate did (the manifest's ``calibration``), empty when never calibrated.
        reference: the drift reference samples.
        metrics: the metrics recorded for this calibration.
    """

    key: str
    head: dict
    thresholds: Abstention
    conformal: Conformal | None
    record: dict
    reference: dict
    metrics: dict


def _section(cls, name: str, data):
    """``cls(**data)`` for the manifest section ``name``; ArtifactError naming what is wrong."""
    if not isinstance(data, dict):
        raise ArtifactError(f"manifest {name} must be a JSON object, got {data!r}")
    try:
        return cls(**data)
    except TypeError as e:
        raise ArtifactError(f"invalid manifest {name} {data}: {e}") from e


@dataclass
class Manifest:
    """Everything needed to serve and to trust an adapter, besides its tensors.

    The typed sections (``base_model``, ``head``, ``prompt``, ``abstention``, ``conformal``) are stored as
    dicts and name their dataclass in the field's ``section`` metadata: loading validates through it and the
    JSON Schema (ibedl.core.manifest_schema) is derived from it.

    Attributes:
        method: registry key of the training method (``map``, ``edl``, ``ib_edl``, ...).
        base_model: the base weights the adapter was trained on.
        head: the option head's configuration.
        option_token_ids: tokenizer ids of " A", " B", ... used to initialise the head rows.
        prompt: the prompt template and training token cut.
        name, version: how the service names the adapter.
        method_config: the method's hyper-parameters (beta, K, ...).
        members: adapter sub-directories ("." for a single adapter; members/<i> for an ensemble), relative paths
            inside the artifact (never absolute, never through "..").
        mc_samples: forward passes with dropout on at inference (MC-Dropout), 0 for none.
        training: data, sizes, seeds, steps, the command that produced the artifact.
        metrics: split name -> evaluation metrics (``validation``, ``test``, ``test_before_calibration``).
        abstention: default thresholds and how they were chosen.
        conformal: split-conformal quantiles, or empty when the adapter was never calibrated.
        calibration: what ibedl.training.calibrate did (data, post-hoc fit, gate, risk control), or empty.
        reference: ``uncertainty`` and ``confidence`` samples and their ``split``, for drift monitoring.
        calibrated_on: the backend and precision whose raw outputs the head's post-hoc parameter, ``abstention``,
            ``conformal``, ``calibration`` and ``reference`` were computed from (ibedl.core.backends.calibration_key:
            ``torch-fp32``, ``torch-cuda-bf16``, ``openvino-bf16``, ...).
        backend_calibrations: backend and precision -> the same sections calibrated on that backend
            (``python -m ibedl.training.calibrate --backend NAME``); the service serves the one matching its backend.
        files: sha256 of each weight file (adapter and head safetensors of every member) by its path
            relative to the artifact; empty where not recorded (artifacts migrated from schema version 1
            before ``python -m ibedl.core.migrate`` wrote them), and then the service refuses to load it.
        limitations: what a user must know that the numbers do not say (measured limits); the model card
            lists them under "Intended use and limits".
        schema_version: the manifest format's version (older ones are migrated when read).
    """

    method: str
    base_model: dict = field(metadata={"section": BaseModelRef})
    head: dict = field(metadata={"section": HeadConfig})
    option_token_ids: list[int]
    prompt: dict = field(metadata={"section": PromptConfig})
    name: str = "adapter"
    version: str = "0"
    method_config: dict = field(default_factory=dict)
    members: list[str] = field(default_factory=lambda: ["."])
    mc_samples: int = 0
    training: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    abstention: dict = field(default_factory=lambda: asdict(Abstention()), metadata={"section": Abstention})
    conformal: dict = field(default_factory=dict, metadata={"section": Conformal, "may_be_empty": True})
    calibration: dict = field(default_factory=dict)
    reference: dict = field(default_factory=dict)
    calibrated_on: str = "torch-fp32"
    backend_calibrations: dict[str, dict] = field(default_factory=dict, metadata={"values": BackendCalibration})
    files: dict[str, str] = field(default_factory=dict)
    limitations: list[str] = field(default_factory=list)
    schema_version: int = field(default=SCHEMA_VERSION, metadata={"const": True})

    def __post_init__(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise ArtifactError(f"manifest schema_version {self.schema_version} is not {SCHEMA_VERSION}; "
                                "read manifests with Manifest.from_dict or read_manifest, which migrate older ones")
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
        for member in self.members:
            check_member(member)
        if self.mc_samples < 0:
            raise ArtifactError(f"mc_samples must be >= 0, got {self.mc_samples}")
        if not all(isinstance(x, str) for x in self.limitations):
            raise ArtifactError(f"manifest limitations must be a list of strings, got {self.limitations!r}")
        if not isinstance(self.backend_calibrations, dict) or self.calibrated_on in self.backend_calibrations:
            raise ArtifactError(f"manifest backend_calibrations must be an object without calibrated_on "
                                f"({self.calibrated_on!r}), whose calibration is the top-level one")
        for key, data in self.backend_calibrations.items():
            try:
                _section(BackendCalibration, f"backend_calibrations.{key}", data)
            except ValueError as e:
                raise ArtifactError(f"invalid manifest backend_calibrations.{key}: {e}") from e

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

    def calibration_keys(self) -> list[str]:
        """The backends and precisions this manifest carries a calibration for, the top-level one first."""
        return [self.calibrated_on, *self.backend_calibrations]

    def calibration_for(self, key: str) -> ServedCalibration | None:
        """The calibration made on backend and precision ``key``, or None when the manifest carries none."""
        if key == self.calibrated_on:
            head = self.head_config()
            return ServedCalibration(key, {} if head.posthoc_key is None else
                                     {head.posthoc_key: getattr(head, head.posthoc_key)},
                                     self.thresholds(), self.conformal_sets(), self.calibration, self.reference,
                                     self.metrics)
        if key not in self.backend_calibrations:
            return None
        c = BackendCalibration(**self.backend_calibrations[key])
        return ServedCalibration(key, c.head, Abstention(**c.abstention), Conformal(**c.conformal) if c.conformal
                                 else None, c.calibration, c.reference, c.metrics)

    def set_calibration(self, key: str, head: dict, sections: dict, metrics: dict | None = None) -> None:
        """Record a calibration made on ``key``: the top-level sections (and the head's post-hoc parameter) when
        ``key`` is ``calibrated_on``, else ``backend_calibrations[key]``. ``sections``: ``abstention``,
        ``conformal``, ``calibration``, ``reference`` (ibedl.training.calibrate.calibrate_outputs); ``metrics``:
        split -> metrics measured under it."""
        if key == self.calibrated_on:
            self.head = {**self.head, **head}
            for name in ("abstention", "conformal", "calibration", "reference"):
                setattr(self, name, sections[name])
            self.metrics.update(metrics or {})
            return
        entry = BackendCalibration(head=dict(head), metrics=dict(metrics or {}),
                                   **{name: sections[name] for name in ("abstention", "conformal", "calibration",
                                                                        "reference")})
        self.backend_calibrations[key] = asdict(entry)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        """A manifest as stored, of this schema version or an older one (migrated: :func:`migrate`)."""
        data = migrate(data)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ArtifactError(f"manifest has unknown keys {unknown}")
        try:
            return cls(**data)
        except TypeError as e:
            raise ArtifactError(f"invalid manifest: {e}") from e


# -- versions ---------------------------------------------------------------------------------------------


def _v1_to_v2(data: dict) -> dict:
    """Version 2: ``head`` no longer carries ``extra`` (nothing ever read it); ``base_model.ref`` is required and
    portable (a known name instead of this machine's conversion-cache path; the name where it was missing);
    ``files`` and ``limitations`` are new (empty: python -m ibedl.core.migrate records the files' sha256)."""
    if isinstance(data.get("head"), dict):
        data["head"].pop("extra", None)
    base = data.get("base_model")
    if isinstance(base, dict) and "name" in base:
        base["ref"] = portable_ref(base.get("ref") or base["name"], str(base.get("sha256", "")))
    return data


def _v2_to_v3(data: dict) -> dict:
    """Version 3: calibrations per backend. ``calibrated_on`` names the backend and precision of the top-level
    calibration: the torch model in the precision training ran it in (``torch-fp32`` on the CPU; on CUDA the
    training dtype, bfloat16 unless one was set, ``nf4`` with a 4-bit base); ``backend_calibrations`` is new
    (empty)."""
    from ibedl.core.backends import calibration_key

    training = data.get("training") if isinstance(data.get("training"), dict) else {}
    config = training.get("config") if isinstance(training.get("config"), dict) else {}
    device = str(training.get("device") or "cpu")
    dtype = config.get("dtype") or ("bfloat16" if device.startswith("cuda") else "float32")
    data.setdefault("calibrated_on", calibration_key("torch", device, dtype, bool(config.get("load_in_4bit"))))
    data.setdefault("backend_calibrations", {})
    return data


# MIGRATIONS[k] turns a version-k manifest dict into version k + 1. A format change adds one function here,
# bumps SCHEMA_VERSION, and regenerates the JSON Schema (python -m ibedl.core.manifest_schema).
MIGRATIONS = {1: _v1_to_v2, 2: _v2_to_v3}


def migrate(data: dict) -> dict:
    """A manifest dict of any known schema version as the current version (a new dict; ``data`` is untouched).

    Raises ArtifactError naming the version found and what to do: a newer version needs a newer ibedl, an
    unknown or missing one cannot be read.
    """
    if not isinstance(data, dict):
        raise ArtifactError(f"a manifest is a JSON object, got {type(data).__name__}")
    found = data.get("schema_version")
    oldest = min(MIGRATIONS, default=SCHEMA_VERSION)
    if isinstance(found, bool) or not isinstance(found, int) or found < oldest:
        raise ArtifactError(
            f"manifest schema_version is {found!r}; this ibedl reads versions {oldest} to {SCHEMA_VERSION} "
            f"(older ones are migrated when read, and written back by {MIGRATE_COMMAND} DIR). A manifest "
            "without a known version was not written by ibedl: retrain the adapter with "
            "python -m ibedl.training.finetune"
        )
    if found > SCHEMA_VERSION:
        raise ArtifactError(
            f"manifest schema_version {found} is newer than this ibedl reads ({SCHEMA_VERSION}): upgrade ibedl "
            "(pip install -U ibedl) to load this adapter"
        )
    data = copy.deepcopy(data)
    for version in range(found, SCHEMA_VERSION):
        data = MIGRATIONS[version](data)
        data["schema_version"] = version + 1
    return data


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: readers see the old or the new file, never
    half. The file keeps the mode it had, else gets the one ``open`` would give it (0666 less the umask, as the
    weights beside it): mkstemp's 0600 left a manifest the image's non-root user could not read from a mounted
    artifact."""
    path = Path(path)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        with contextlib.suppress(OSError):  # a file system without modes: the write still stands
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets it, racing other threads); 022 where the
    kernel does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def manifest_json(manifest: Manifest) -> str:
    """``manifest.json`` as written: indented JSON in field order, with a final newline."""
    return json.dumps(manifest.to_dict(), indent=2, sort_keys=False) + "\n"


def write_manifest(directory: str | Path, manifest: Manifest) -> Path:
    path = Path(directory) / MANIFEST
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, manifest_json(manifest))
    return path


def read_manifest_data(directory: str | Path) -> dict:
    """``manifest.json`` of ``directory`` as stored (not migrated), checked to be a JSON object."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{path} not found: is {directory} an adapter directory?")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: expected a JSON object")
    return data


def read_manifest(directory: str | Path) -> Manifest:
    """The manifest of ``directory``; one of an older schema version is migrated (and a warning says how to
    write it back)."""
    data = read_manifest_data(directory)
    manifest = Manifest.from_dict(data)
    if data.get("schema_version") != SCHEMA_VERSION:
        log.warning("%s has manifest schema_version %s, read as %s; write it in the current version with: %s %s",
                    directory, data.get("schema_version"), SCHEMA_VERSION, MIGRATE_COMMAND, directory)
    return manifest


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


def check_member(member) -> None:
    """ArtifactError unless ``member`` (an entry of a manifest's ``members``) is a relative POSIX path that stays
    inside the artifact directory ("." or "members/0"; never absolute, never through "..")."""
    if not isinstance(member, str) or not member:
        raise ArtifactError(f"manifest members are relative directory paths, got {member!r}")
    windows = PureWindowsPath(member)
    if PurePosixPath(member).is_absolute() or windows.drive or windows.root or "\\" in member:
        raise ArtifactError(f"manifest member {member!r} is an absolute path: members are directories inside the "
                            "artifact, relative to it ('.' or 'members/0')")
    if ".." in PurePosixPath(member).parts:
        raise ArtifactError(f"manifest member {member!r} leaves the artifact directory ('..'): members are "
                            "directories inside it ('.' or 'members/0')")


def _inside(directory: Path, path: Path) -> None:
    """ArtifactError unless ``path``, symlinks followed, is inside ``directory`` (symlinks followed too)."""
    root, real = directory.resolve(), path.resolve()
    if real != root and not real.is_relative_to(root):
        raise ArtifactError(f"{path} leads to {real}, outside the artifact directory {root} (a symlink): an "
                            "artifact's files must be inside it")


def check_artifact(directory: str | Path, verify: bool = False) -> Manifest:
    """Read the manifest and check every file it implies exists. Returns the manifest.

    Args:
        verify: also check each weight file against the sha256 the manifest's ``files`` records (a manifest that
            records none is refused: :func:`verify_files`).
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    for member in manifest.members:
        _inside(directory, directory / member)
        for name in (*ADAPTER_FILES, HEAD_FILE):
            if not (directory / member / name).is_file():
                raise ArtifactError(f"{directory / member / name} not found")
            _inside(directory, directory / member / name)
    if verify:
        verify_files(directory, manifest)
    return manifest


def weight_files(members: list[str]) -> list[str]:
    """Paths of the weight files of ``members``, relative to the artifact ("adapter_model.safetensors",
    "members/0/head.safetensors", ...)."""
    return [(Path(member) / name).as_posix() for member in members for name in WEIGHT_FILES]


def files_sha256(directory: str | Path, members: list[str]) -> dict[str, str]:
    """The manifest's ``files`` section: sha256 of every weight file of ``members`` under ``directory``."""
    return {path: sha256_file(Path(directory) / path) for path in weight_files(members)}


def verify_files(directory: str | Path, manifest: Manifest) -> None:
    """ArtifactError naming each weight file whose sha256 differs from the manifest's ``files`` (or that the
    manifest does not record); ArtifactError when ``files`` is empty: weights nothing vouches for are not loaded."""
    if not manifest.files:
        raise ArtifactError(f"{directory}: the manifest records no sha256 of the weight files, so they cannot be "
                            f"checked and are not loaded. Record them with: {MIGRATE_COMMAND} {directory} (it hashes "
                            "the weights as they are now: run it only on an artifact you trust)")
    actual = files_sha256(directory, manifest.members)
    bad = sorted(p for p in set(actual) | set(manifest.files) if actual.get(p) != manifest.files.get(p))
    if bad:
        raise ArtifactError(f"{directory}: weight files {bad} differ from the sha256 the manifest records: "
                            "the weights changed after the manifest was written; retrain or restore them")
