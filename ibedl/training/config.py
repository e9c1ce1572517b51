"""Fine-tuning configuration: dataclasses that validate on construction, read from YAML with
``key.sub=value`` overrides from the command line."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import re

import yaml

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


@dataclass
class DataPart:
    """One dataset split to draw from: ``{dataset, split?, limit?, path?}``."""

    dataset: str
    limit: int | None = None
    path: str | None = None
    split: str | None = None  # default: the role's split (train / validation / test)

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"data limit must be >= 1, got {self.limit} for {self.dataset}")


@dataclass
class DataConfig:
    """Training, validation and test mixtures, and label noise on the training part."""

    train: list[DataPart]
    validation: list[DataPart]
    test: list[DataPart] = field(default_factory=list)
    label_noise: float = 0.0
    noise_seed: int = 0
    # The seed of the training subsets (a part's `limit`); None: the run's seed. A second stage that
    # should see the first stage's questions again (a true second epoch) sets the first stage's seed here.
    subset_seed: int | None = None

    def __post_init__(self) -> None:
        for role in ("train", "validation", "test"):
            parts = [p if isinstance(p, DataPart) else DataPart(**p) for p in getattr(self, role)]
            setattr(self, role, parts)
        if not self.train:
            raise ValueError("data.train must name at least one dataset")
        if not self.validation:
            raise ValueError("data.validation must name at least one dataset (thresholds are chosen on it)")
        if not 0.0 <= self.label_noise < 1.0:
            raise ValueError(f"data.label_noise must be in [0, 1), got {self.label_noise}")


@dataclass
class LoraSettings:
    r: int = 8
    alpha: int = 16
    dropout: float = 0.1
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"lora.r must be >= 1, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ValueError("lora.targets must name at least one module")


@dataclass
class OptimSettings:
    lr: float = 5e-5
    head_lr: float | None = None  # default: same as lr
    weight_decay: float = 0.0
    batch_size: int = 4
    epochs: float = 1.0
    max_steps: int | None = None
    warmup_ratio: float = 0.1
    schedule: str = "cosine"
    clip_grad_norm: float | None = None  # default: the method's (20 for the EDL family)
    # Batches per optimizer step; one step then sees batch_size x processes x gradient_accumulation_steps questions.
    gradient_accumulation_steps: int = 1
    # Early stopping: validation after every epoch (or every eval_every steps); training stops after this many passes
    # without a lower validation NLL and keeps the best state. None trains the whole budget (epochs / max_steps).
    patience: int | None = None

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.batch_size < 1:
            raise ValueError(f"optim.batch_size must be >= 1, got {self.batch_size}")
        if self.epochs <= 0:
            raise ValueError(f"optim.epochs must be > 0, got {self.epochs}")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"optim.schedule must be cosine, linear or constant, got {self.schedule!r}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"optim.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.gradient_accumulation_steps < 1:
            raise ValueError(f"optim.gradient_accumulation_steps must be >= 1, got {self.gradient_accumulation_steps}")
        if self.patience is not None and (isinstance(self.patience, bool) or not isinstance(self.patience, int)
                                          or self.patience < 1):
            raise ValueError(f"optim.patience must be an integer >= 1 or null, got {self.patience!r}")


@dataclass
class TrainConfig:
    """A fine-tuning run. YAML files under ``ibedl/training/configs/`` map onto this one-to-one."""

    method: str
    data: DataConfig
    output: str
    base_model: str = "smollm2-135m-instruct"
    name: str | None = None
    version: str = "1"
    method_params: dict = field(default_factory=dict)
    template: str = "plain-v1"
    max_tokens: int = 512
    num_rows: int = 26
    lora: LoraSettings = field(default_factory=LoraSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    seed: int = 0
    eval_every: int = 0  # steps between validation passes (0: only at the end)
    eval_limit: int = 200  # validation questions used by periodic passes
    eval_batch_size: int = 8
    # evidential heads: "center" the first batch's pre-evidence, "none", or a value
    evidence_bias: str | float = "center"
    train_evidence_bias: bool = True  # False keeps that shared offset fixed during training
    centre_options: bool = False  # evidential heads: pre-evidence minus its mean over the question's options
    evidence_scale: float = 1.0  # evidential heads: pre-evidence = s * (W h) + b (HeadConfig.evidence_scale)
    # an artifact whose LoRA weights and option rows start this run (ibedl.training.warm_start)
    init_from: str | None = None
    train_layers: int | None = None  # LoRA trains in the top K decoder layers only; the states below are cached
    target_accuracy: float = 0.8
    fit_zeta: bool = True
    reference_size: int = 1000
    device: str | None = None
    dtype: str | None = None  # float32 | bfloat16 | float16; default by device (float32 under mixed_precision)
    # bf16 | fp16: autocast on CUDA (ibedl.training.distributed); head and losses stay float32
    mixed_precision: str = "no"
    fsdp: bool = False  # under accelerate launch: FSDP2 shards the base model instead of replicating it (DDP)
    load_in_4bit: bool = False
    threads: int | None = None
    progress: bool = True
    track: str | None = None  # tensorboard | mlflow: losses, metrics and the manifest through accelerate's trackers
    track_dir: str = "runs"  # TensorBoard logs under <track_dir>/<name>; MLflow's artifact location

    def __post_init__(self) -> None:
        if isinstance(self.data, dict):
            self.data = DataConfig(**self.data)
        if isinstance(self.lora, dict):
            self.lora = LoraSettings(**self.lora)
        if isinstance(self.optim, dict):
            self.optim = OptimSettings(**self.optim)
        if self.max_tokens < 16:
            raise ValueError(f"max_tokens must be >= 16, got {self.max_tokens}")
        if not 2 <= self.num_rows <= 26:
            raise ValueError(f"num_rows must be in 2..26, got {self.num_rows}")
        if not 0 < self.target_accuracy <= 1:
            raise ValueError(f"target_accuracy must be in (0, 1], got {self.target_accuracy}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.mixed_precision not in PRECISIONS:
            raise ValueError(f"mixed_precision must be one of {list(PRECISIONS)}, got {self.mixed_precision!r}")
        if self.track is not None and self.track not in TRACKERS:
            raise ValueError(f"track must be one of {list(TRACKERS)}, got {self.track!r}")
        if self.fsdp and self.load_in_4bit:
            raise ValueError("fsdp cannot shard a 4-bit base (load_in_4bit); use one or the other")
        if self.fsdp and self.optim.patience:
            raise ValueError("fsdp trains without early stopping (optim.patience must be null): the head is sharded "
                             "between steps")
        if self.fsdp and self.eval_every:
            raise ValueError("fsdp trains without periodic validation (eval_every must be 0): the head is sharded "
                             "between steps; the artifact is still validated at the end")
        if not (self.evidence_bias in ("center", "none") or isinstance(self.evidence_bias, (int, float))):
            raise ValueError(f"evidence_bias must be 'center', 'none' or a number, got {self.evidence_bias!r}")
        check_evidence_scale(self.evidence_scale)
        if self.init_from is not None and not (Path(self.init_from) / "manifest.json").is_file():
            raise ValueError(f"init_from must be an artifact directory with a manifest.json, got {self.init_from!r}")
        if self.train_layers is not None and (isinstance(self.train_layers, bool)
                                              or not isinstance(self.train_layers, int) or self.train_layers < 1):
            raise ValueError(f"train_layers must be a positive number of top layers or null, got {self.train_layers!r}")
        if self.train_layers is not None and self.fsdp:
            raise ValueError("train_layers runs the top layers on cached states, which fsdp cannot shard; use one or "
                             "the other")
        if self.name is None:
            self.name = Path(self.output).name

    def to_dict(self) -> dict:
        return asdict(self)


def config_keys_help() -> str:
    """Every config key with its default (``--help`` of the training commands), read from the dataclasses above,
    so the list cannot drift from what ``load_config`` accepts."""
    import dataclasses

    def walk(cls, prefix: str):
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            nested = (None if prefix
                      else {"data": DataConfig, "lora": LoraSettings, "optim": OptimSettings}.get(f.name))
            if nested is not None:
                yield from walk(nested, key + ".")
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = "(required)"
            if isinstance(default, list) and default and isinstance(default[0], DataPart):
                default = "(required)"
            yield f"  {key} = {default}"

    lines = list(walk(TrainConfig, ""))
    lines[lines.index("  data.train = (required)")] += "   (a list of {dataset, split?, limit?, path?})"
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
    try:
        return TrainConfig(**data)
    except TypeError as e:
        raise ValueError(f"invalid config: {e}") from e


_NESTED = {"data": DataConfig, "lora": LoraSettings, "optim": OptimSettings}


def _check_keys(cls, data: dict, prefix: str) -> None:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown config keys {[prefix + k for k in unknown]}; known: {sorted(names)}")
    for key, sub in _NESTED.items():
        if cls is TrainConfig and isinstance(data.get(key), dict):
            _check_keys(sub, data[key], f"{key}.")


__all__ = ["TrainConfig", "DataConfig", "DataPart", "LoraSettings", "OptimSettings", "load_config"]
