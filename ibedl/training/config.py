"""Fine-tuning configuration: pydantic models (typed, unknown keys refused, bounds in ``Field``, validators for the
rules across fields) read from YAML with ``key.sub=value`` overrides from the command line. A bad value is a
ValueError naming the key and the value (:func:`describe`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args

import re

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

from ibedl.core.head import check_evidence_scale

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


Real = Union[int, float]  # a number kept as written (an int stays an int in to_dict and the manifest)


class _Model(BaseModel):
    """Typed, unknown keys refused; nested models and lists of them validate on construction."""

    model_config = ConfigDict(extra="forbid")

    def to_dict(self) -> dict:
        return self.model_dump()


class DataPart(_Model):
    """One dataset split to draw from: ``{dataset, split?, limit?, path?}``."""

    dataset: str
    limit: Optional[StrictInt] = Field(None, ge=1)
    path: Optional[str] = None
    split: Optional[str] = None  # default: the role's split (train / validation / test)


class DataConfig(_Model):
    """Training, validation and test mixtures, and label noise on the training part."""

    train: list[DataPart]
    validation: list[DataPart]
    test: list[DataPart] = Field(default_factory=list)
    label_noise: Real = Field(0.0, ge=0.0, lt=1.0)
    noise_seed: int = 0
    # The seed of the training subsets (a part's `limit`); None: the run's seed. A second stage that
    # should see the first stage's questions again (a true second epoch) sets the first stage's seed here.
    subset_seed: Optional[int] = None

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
    alpha: Real = 16
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
    head_lr: Optional[Real] = None  # default: same as lr
    weight_decay: Real = 0.0
    batch_size: StrictInt = Field(4, ge=1)
    epochs: Real = Field(1.0, gt=0)
    max_steps: Optional[StrictInt] = None
    warmup_ratio: Real = Field(0.1, ge=0.0, lt=1.0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    clip_grad_norm: Optional[Real] = None  # default: the method's (20 for the EDL family)
    # Batches per optimizer step; one step then sees batch_size x processes x gradient_accumulation_steps questions.
    gradient_accumulation_steps: StrictInt = Field(1, ge=1)
    # Early stopping: validation after every epoch (or every eval_every steps); training stops after this many passes
    # without a lower validation NLL and keeps the best state. None trains the whole budget (epochs / max_steps).
    patience: Optional[int] = None

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
    name: Optional[str] = None
    version: Union[str, int] = "1"
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
    evidence_bias: Union[str, Real] = "center"
    train_evidence_bias: bool = True  # False keeps that shared offset fixed during training
    centre_options: bool = False  # evidential heads: pre-evidence minus its mean over the question's options
    evidence_scale: Real = 1.0  # evidential heads: pre-evidence = s * (W h) + b (HeadConfig.evidence_scale)
    # an artifact whose LoRA weights and option rows start this run (ibedl.training.warm_start)
    init_from: Optional[str] = None
    train_layers: Optional[int] = None  # LoRA trains in the top K decoder layers only; the states below are cached
    target_accuracy: Real = Field(0.8, gt=0, le=1)
    fit_zeta: bool = True
    reference_size: StrictInt = Field(1000, ge=10)
    device: Optional[str] = None
    # float32 | bfloat16 | float16; default by device (float32 under mixed_precision)
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    # bf16 | fp16: autocast on CUDA (ibedl.training.distributed); head and losses stay float32
    mixed_precision: Literal[PRECISIONS] = "no"
    fsdp: bool = False  # under accelerate launch: FSDP2 shards the base model instead of replicating it (DDP)
    load_in_4bit: bool = False
    threads: Optional[StrictInt] = Field(None, ge=1)
    progress: bool = True
    track: Optional[Literal[TRACKERS]] = None  # tensorboard | mlflow: losses, metrics and the manifest (accelerate)
    track_dir: str = "runs"  # TensorBoard logs under <track_dir>/<name>; MLflow's artifact location

    @field_validator("evidence_bias", mode="before")
    @classmethod
    def _evidence_bias(cls, value):
        if not (value in ("center", "none") or (isinstance(value, (int, float)) and not isinstance(value, bool))):
            raise ValueError(f"evidence_bias must be 'center', 'none' or a number, got {value!r}")
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
        from ibedl.training.methods import get_method  # here: the method registry imports this module

        get_method(self.method).params(self.method_params)  # refused now, naming the key, not when training starts
        if self.name is None:
            self.name = Path(self.output).name
        return self

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ValueError(describe(e)) from None


_NESTED = {"data": DataConfig, "lora": LoraSettings, "optim": OptimSettings}


def _bounds(model: type[BaseModel], name: str) -> str | None:
    """'in [0, 1)', '> 0', '>= 1', ... from a field's Field(ge/gt/le/lt) bounds; None without any."""
    low = high = None
    for m in model.model_fields[name].metadata:
        for attr, kind in (("ge", "["), ("gt", "("), ("le", "]"), ("lt", ")")):
            value = getattr(m, attr, None)
            if value is not None:
                if kind in "[(":
                    low = (kind, value)
                else:
                    high = (kind, value)
    if low and high:
        return f"in {low[0]}{low[1]:g}, {high[1]:g}{high[0]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {low[1]:g}"
    if high:
        return f"{'<=' if high[0] == ']' else '<'} {high[1]:g}"
    return None


_NUMBER_ERRORS = {"finite_number", "float_type", "float_parsing", "int_type", "int_parsing", "int_from_float",
                  "greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def describe(error: ValidationError, model: type[BaseModel] | None = None, prefix: str = "") -> str:
    """A pydantic ValidationError as one line per bad key, naming the key (``optim.lr``, with ``prefix`` before it)
    and the value given: ``optim.lr must be > 0, got -1``. ``model``: the model that raised it (default: found by
    the error's title among this module's). The validators' own messages (they name key and value) are kept."""
    lines, seen = [], set()
    if model is None:
        model = {"TrainConfig": TrainConfig, **{m.__name__: m for m in (*_NESTED.values(), DataPart)}}.get(error.title)
    errors = error.errors()
    for e in errors:
        loc = [p for p in e["loc"] if not _is_tag(p)]  # field names and list indices
        key = prefix + ".".join(str(p) for p in loc)
        if key in seen:
            continue  # a union's alternatives each report the same bad value
        seen.add(key)
        if e["type"] == "value_error":
            lines.append(str(e["ctx"]["error"]))
            continue
        names = [p for p in loc if isinstance(p, str)]
        owner = _owner(model, names)
        field = owner.model_fields.get(names[-1]) if owner is not None and names else None
        bounds = _bounds(owner, names[-1]) if field is not None else None
        types = {x["type"] for x in errors if [p for p in x["loc"] if not _is_tag(p)] == loc}
        kind = _number_kind(field)
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown config keys [{key!r}]")
        elif kind and types <= _NUMBER_ERRORS:  # a number field: one message for its type, nan and bounds
            null = " (or null)" if field.default is None and not field.is_required() else ""
            lines.append(f"{key} must be {kind}{' ' + bounds if bounds else ''}{null}, got {e['input']!r}")
        elif e["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal") and bounds:
            lines.append(f"{key} must be {bounds}, got {e['input']!r}")
        elif e["type"] == "literal_error":
            lines.append(f"{key} must be {e['ctx']['expected']}, got {e['input']!r}")
        elif types & {"float_parsing", "float_type"}:
            lines.append(f"{key} must be a number, got {e['input']!r}")
        elif types & {"int_parsing", "int_type", "int_from_float"}:
            lines.append(f"{key} must be an integer, got {e['input']!r}")
        else:
            lines.append(f"{key}: {e['msg'][:1].lower()}{e['msg'][1:]}, got {e['input']!r}")
    return "; ".join(lines)


def _number_kind(field) -> str | None:
    """'an integer' or 'a finite number' for a field declared with ``allow_inf_nan=False`` or a strict integer (the
    methods' hyper-parameters), so one message covers a wrong type, nan and the bounds; None otherwise."""
    if field is None:
        return None
    types = {a for a in (field.annotation, *get_args(field.annotation)) if a is not type(None)}
    for a in list(types):
        types |= set(get_args(a))
    floats = float in types
    finite = any(getattr(m, "allow_inf_nan", None) is False for m in field.metadata)
    if finite and floats:
        return "a finite number"
    if finite or (field.metadata and types and all("int" in str(a).lower() for a in types)):
        return "an integer"
    return None


def _is_tag(part) -> bool:
    """A union member's or validator's tag in a pydantic error location (``int``, ``literal['center','none']``,
    ``function-before[...]``), not a key."""
    return isinstance(part, str) and (part in ("int", "float", "str", "bool", "none")
                                      or not part.replace("_", "a").isalnum())


def _owner(model: type[BaseModel] | None, loc: list[str]) -> type[BaseModel] | None:
    """The model that declares the last key of ``loc`` (a path of field names from ``model``)."""
    for part in loc[:-1]:
        if model is None or part not in model.model_fields:
            return None
        sub = model.model_fields[part].annotation
        sub = next((a for a in (sub, *get_args(sub)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if sub is None:
            args = [a for a in get_args(model.model_fields[part].annotation)]
            sub = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        model = sub
    return model


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

    from ibedl.training.methods import METHODS  # here: the method registry imports this module

    lines = list(walk(TrainConfig, ""))
    lines[lines.index("  data.train = (required)")] += "   (a list of {dataset, split?, limit?, path?})"
    lines.append("method_params (per method, with their defaults):")
    lines += [f"  {name}: " + ", ".join(f"{k} = {v}" for k, v in method.defaults.items())
              for name, method in METHODS.items() if method.defaults]
    return ("config keys (YAML, or key.sub=value on the command line; what each means: docs/reference/config.md):\n"
            + "\n".join(lines))


def _parse_value(text: str) -> Any:
    return yaml_load(text)


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
        node[parts[-1]] = _parse_value(value)
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
