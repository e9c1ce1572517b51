"""Fine-tuning configuration: pydantic models (typed, unknown keys refused, bounds in ``Field``, validators for the
rules across fields) read from YAML with ``key.sub=value`` overrides from the command line. A bad value is a
ValueError naming the key and the value (:func:`describe`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

from ibedl.core.head import check_evidence_scale
from ibedl.training.config_errors import describe
from ibedl.training.methods import METHODS, get_method

PRECISIONS = ("no", "bf16", "fp16")  # mixed_precision: accelerate's names
TRACKERS = ("tensorboard", "mlflow")  # track: accelerate's trackers this project logs to


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads 1e-3 as a float (YAML 1.1 wants 1.0e-3, which nobody writes)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


FLOAT32_MAX = 3.4028234663852886e38  # the head's parameters are float32
Real = int | float  # a number kept as written (an int stays an int in to_dict and the manifest)


class _Model(BaseModel):
    """Typed, unknown keys refused, no NaN or infinite number (``optim.lr=.inf`` trained to a NaN loss, ``optim.epochs=
    .inf`` failed converting it to steps); nested models and lists of them validate on construction."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    def to_dict(self) -> dict:
        return self.model_dump()


class DataPart(_Model):
    """One dataset split to draw from: ``{dataset, split?, limit?, path?}``."""

    dataset: str
    limit: StrictInt | None = Field(None, ge=1)
    path: str | None = None
    split: str | None = None  # default: the role's split (train / validation / test)


class DataConfig(_Model):
    """Training, validation and test mixtures, and label noise on the training part."""

    train: list[DataPart]
    validation: list[DataPart]
    test: list[DataPart] = Field(default_factory=list)
    label_noise: Real = Field(0.0, ge=0.0, lt=1.0)
    noise_seed: int = 0
    # The seed of the training subsets (a part's `limit`); None: the run's seed. A second stage that
    # should see the first stage's questions again (a true second epoch) sets the first stage's seed here.
    subset_seed: int | None = None
    # An artifact directory (usually the run's init_from): the training subsets are drawn from the questions that
    # artifact's own training did not draw, so a run that starts from it has not seen its training questions' labels.
    disjoint_from: str | None = None

    @field_validator("disjoint_from")
    @classmethod
    def _disjoint_from(cls, value):
        if value is None:
            return value
        manifest = Path(value) / "manifest.json"
        if not manifest.is_file():
            raise ValueError(f"data.disjoint_from must be an artifact directory with a manifest.json, got {value!r}")
        if "config" not in (json.loads(manifest.read_text()).get("training") or {}):
            raise ValueError(f"data.disjoint_from {value!r}: its manifest has no training.config, so the questions "
                             "it was trained on are unknown")
        return value

    @field_validator("train")
    @classmethod
    def _some_train(cls, parts: list[DataPart]) -> list[DataPart]:
        if not parts:
            raise ValueError("data.train must name at least one dataset")
        return parts

    @field_validator("validation")
    @classmethod
    def _some_validation(cls, parts: list[DataPart]) -> list[DataPart]:
        if not parts:
            raise ValueError("data.validation must name at least one dataset (thresholds are chosen on it)")
        return parts


class LoraSettings(_Model):
    r: StrictInt = Field(8, ge=1)
    alpha: Real = Field(16, gt=0)  # 0 would scale the adapter to nothing: no LoRA at all
    dropout: Real = Field(0.1, ge=0.0, lt=1.0)
    targets: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"])

    @field_validator("targets")
    @classmethod
    def _some_targets(cls, targets: list[str]) -> list[str]:
        if not targets:
            raise ValueError("lora.targets must name at least one module")
        return targets


class OptimSettings(_Model):
    lr: Real = Field(5e-5, gt=0)
    head_lr: Real | None = Field(None, gt=0)  # default: same as lr
    weight_decay: Real = Field(0.0, ge=0)
    batch_size: StrictInt = Field(4, ge=1)
    epochs: Real = Field(1.0, gt=0)
    max_steps: StrictInt | None = Field(None, ge=1)
    warmup_ratio: Real = Field(0.1, ge=0.0, lt=1.0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    clip_grad_norm: Real | None = Field(None, gt=0)  # default: the method's (20 for the EDL family)
    # Batches per optimizer step; one step then sees batch_size x processes x gradient_accumulation_steps questions.
    gradient_accumulation_steps: StrictInt = Field(1, ge=1)
    # Early stopping: validation after every epoch (or every eval_every steps); training stops after this many passes
    # without a lower validation NLL and keeps the best state. None trains the whole budget (epochs / max_steps).
    patience: int | None = None

    @field_validator("patience", mode="before")
    @classmethod
    def _patience(cls, value):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"optim.patience must be an integer >= 1 or null, got {value!r}")
        return value


class TrainConfig(_Model):
    """A fine-tuning run. YAML files under ``ibedl/training/configs/`` map onto this one-to-one."""

    method: str
    data: DataConfig
    output: str
    base_model: str = "smollm2-135m-instruct"
    name: str | None = None
    version: str | int = "1"
    method_params: dict = Field(default_factory=dict)
    template: str = "plain-v1"
    max_tokens: StrictInt = Field(512, ge=16)
    num_rows: StrictInt = Field(26, ge=2, le=26)
    lora: LoraSettings = Field(default_factory=LoraSettings)
    optim: OptimSettings = Field(default_factory=OptimSettings)
    seed: int = 0
    eval_every: StrictInt = Field(0, ge=0)  # steps between validation passes (0: only at the end)
    eval_limit: StrictInt = Field(200, ge=1)  # validation questions used by periodic passes
    eval_batch_size: StrictInt = Field(8, ge=1)
    # evidential heads: "center" the first batch's pre-evidence, "none", or a value
    evidence_bias: str | Real = "center"
    train_evidence_bias: bool = True  # False keeps that shared offset fixed during training
    centre_options: bool = False  # evidential heads: pre-evidence minus its mean over the question's options
    evidence_scale: Real = 1.0  # evidential heads: pre-evidence = s * (W h) + b (HeadConfig.evidence_scale)
    # an artifact whose LoRA weights and option rows start this run (ibedl.training.warm_start)
    init_from: str | None = None
    # an ensemble: runs whose adapter trained exactly as one of its members (MAP's run of the same seed as its first)
    members_from: list[str] = Field(default_factory=list)
    train_layers: int | None = None  # LoRA trains in the top K decoder layers only; the states below are cached
    target_accuracy: Real = Field(0.8, gt=0, le=1)
    # calibration fits the head's post-hoc parameter: IB-EDL's zeta, a softmax method's temperature (the name is
    # older than the temperature; it stays, as manifests and member fingerprints hold it)
    fit_zeta: bool = True
    reference_size: StrictInt = Field(1000, ge=10)
    # calibration claims an option count only with at least this many validation questions of it
    min_per_count: StrictInt = Field(200, ge=1)
    device: str | None = None
    # float32 | bfloat16 | float16; default by device (float32 under mixed_precision)
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    # bf16 | fp16: autocast on CUDA (ibedl.training.distributed); head and losses stay float32
    mixed_precision: Literal[PRECISIONS] = "no"
    fsdp: bool = False  # under accelerate launch: FSDP2 shards the base model instead of replicating it (DDP)
    # torch.compile the trunk for training (dynamic shapes: prompts vary in length). Off: nobody has yet measured that
    # it pays on a GPU (compilation costs a minute or more; at batch 8 the step is bound by dispatching kernels, which
    # fusion would cut), and on the CPU inductor needs a C++ compiler. Changes float summation order only, so it is
    # not part of a member's fingerprint (ibedl.training.member_resume.NOT_TRAINING).
    torch_compile: bool = False
    # recompute each decoder layer's activations in the backward pass instead of keeping them (transformers'
    # non-reentrant checkpointing): less memory for about one more forward; the same gradients, so not part of a
    # member's fingerprint either
    gradient_checkpointing: bool = False
    load_in_4bit: bool = False
    threads: StrictInt | None = Field(None, ge=1)
    progress: bool = True
    track: Literal[TRACKERS] | None = None  # tensorboard | mlflow: losses, metrics and the manifest (accelerate)
    track_dir: str = "runs"  # TensorBoard logs under <track_dir>/<name>; MLflow's artifact location

    @field_validator("evidence_bias", mode="before")
    @classmethod
    def _evidence_bias(cls, value):
        if not (value in ("center", "none") or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                                and abs(value) <= FLOAT32_MAX)):
            raise ValueError(f"evidence_bias must be 'center', 'none' or a finite float32 number, got {value!r}")
        return value

    @field_validator("evidence_scale", mode="before")
    @classmethod
    def _evidence_scale(cls, value):
        return check_evidence_scale(value)

    @field_validator("init_from")
    @classmethod
    def _init_from(cls, value):
        if value is not None and not (Path(value) / "manifest.json").is_file():
            raise ValueError(f"init_from must be an artifact directory with a manifest.json, got {value!r}")
        return value

    @field_validator("train_layers", mode="before")
    @classmethod
    def _train_layers(cls, value):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"train_layers must be a positive number of top layers or null, got {value!r}")
        return value

    @model_validator(mode="after")
    def _cross_field(self) -> TrainConfig:
        if self.fsdp and self.load_in_4bit:
            raise ValueError("fsdp cannot shard a 4-bit base (load_in_4bit); use one or the other")
        if self.fsdp and self.optim.patience:
            raise ValueError("fsdp trains without early stopping (optim.patience must be null): the head is sharded "
                             "between steps")
        if self.fsdp and self.eval_every:
            raise ValueError("fsdp trains without periodic validation (eval_every must be 0): the head is sharded "
                             "between steps; the artifact is still validated at the end")
        if self.train_layers is not None and self.fsdp:
            raise ValueError("train_layers runs the top layers on cached states, which fsdp cannot shard; use one or "
                             "the other")

        get_method(self.method).params(self.method_params)  # refused now, naming the key, not when training starts
        if self.name is None:
            self.name = Path(self.output).name
        return self

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            models = {"TrainConfig": TrainConfig, **{m.__name__: m for m in (*_NESTED.values(), DataPart)}}
            raise ValueError(describe(e, models.get(e.title))) from None


_NESTED = {"data": DataConfig, "lora": LoraSettings, "optim": OptimSettings}


def config_keys_help() -> str:
    """Every config key with its default (``--help`` of the training commands), read from the models above,
    so the list cannot drift from what ``load_config`` accepts."""

    def walk(cls, prefix: str):
        for name, f in cls.model_fields.items():
            key = prefix + name
            nested = None if prefix else _NESTED.get(name)
            if nested is not None:
                yield from walk(nested, key + ".")
                continue
            default = "(required)" if f.is_required() else f.get_default(call_default_factory=True)
            yield f"  {key} = {default}"


    lines = list(walk(TrainConfig, ""))
    lines[lines.index("  data.train = (required)")] += "   (a list of {dataset, split?, limit?, path?})"
    lines.append("method_params (per method, with their defaults):")
    lines += [f"  {name}: " + ", ".join(f"{k} = {v}" for k, v in method.defaults.items())
              for name, method in METHODS.items() if method.defaults]
    return ("config keys (YAML, or key.sub=value on the command line; what each means: docs/reference/config.md):\n"
            + "\n".join(lines))


def _parse_value(text: str, item: str) -> Any:
    try:
        return yaml_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"override {item!r}: the value is not YAML ({' '.join(str(e).split())})") from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """``["optim.lr=1e-3", "data.train=[{dataset: sciq}]"]`` applied to a nested dict (values as YAML)."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.sub=value")
        key, value = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part!r} is not a mapping")
        node[parts[-1]] = _parse_value(value, item)
    return data


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML config (or start empty) and apply overrides. Unknown keys are an error."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} not found")
        try:
            data = yaml_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: invalid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
    data = apply_overrides(data, list(overrides))
    _check_keys(TrainConfig, data, "")
    return TrainConfig(**data)


def _check_keys(cls, data: dict, prefix: str) -> None:
    names = set(cls.model_fields)
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown config keys {[prefix + k for k in unknown]}; known: {sorted(names)}")
    for key, sub in _NESTED.items():
        if cls is TrainConfig and isinstance(data.get(key), dict):
            _check_keys(sub, data[key], f"{key}.")


__all__ = ["TrainConfig", "DataConfig", "DataPart", "LoraSettings", "OptimSettings", "load_config", "describe"]
