"""Distributed training through accelerate: the run's Accelerator, built from the config, and the module it wraps.

    accelerate launch --multi_gpu --num_processes 4 -m ibedl.training.finetune --config ibedl/training/configs/X.yaml

One process (plain ``python -m ibedl.training.finetune``) stays the default and trains exactly as before. Under N
processes (DDP, or FSDP with ``fsdp: true``) every step draws one global batch of N x ``optim.batch_size``
questions, the batch a single process with that batch size would draw, and each process takes its contiguous
share of it; gradients are averaged across processes, so a step is the step of that single process up to
float summation order. One exception: an epoch's last, short batch is padded by repeating questions so every
process gets a share (accelerate's ``apply_padding``), so those repeats weigh twice in that one step. The main
process alone writes the history, the artifact and the tracker logs.
"""

from __future__ import annotations

import json
import os

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import DistributedType, ProjectConfiguration, is_mlflow_available, is_tensorboard_available

from ibedl.core.head import HeadPrediction
from ibedl.core.predictor import EncodedBatch, Predictor

INSTALLED = {"tensorboard": is_tensorboard_available, "mlflow": is_mlflow_available}  # config.TRACKERS


def reset_accelerator() -> None:
    """Forget accelerate's process-wide state after a run, so a later ``train()`` in the same process (a notebook,
    a test) may choose another device or precision. In a single process only: a launched process trains once."""
    from accelerate.state import AcceleratorState, PartialState

    if PartialState._shared_state and PartialState().num_processes > 1:
        return
    AcceleratorState._reset_state(reset_partial_state=True)


def make_accelerator(cfg) -> Accelerator:
    """The run's Accelerator: processes from the launcher, precision, accumulation, FSDP and tracker from ``cfg``.

    Raises ValueError naming the setting when it cannot run here: mixed precision or FSDP without CUDA,
    a tracker whose package is missing, an explicit device under several processes, a launcher flag that
    contradicts the config.
    """
    check_launcher(cfg)
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    where = cfg.device or "cpu"
    if cfg.mixed_precision != "no" and not cuda:
        raise ValueError(f"mixed_precision={cfg.mixed_precision} needs a CUDA device (autocast is used on CUDA only); "
                         f"this run is on {where}: use mixed_precision=no")
    if cfg.fsdp and not cuda:
        raise ValueError(f"fsdp needs CUDA devices (one process per GPU); this run is on {where}: "
                         "leave fsdp off, and accelerate launch trains with DDP over gloo")
    if cfg.track is not None and not INSTALLED[cfg.track]():
        hint = "pip install -e '.[track]'" if cfg.track == "tensorboard" else "pip install mlflow"
        raise ValueError(f"track={cfg.track} needs the {cfg.track} package ({hint})")
    accelerator = Accelerator(
        cpu=not cuda,
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_steps=cfg.optim.gradient_accumulation_steps,
        device_placement=False,  # build() loads the model where process_device() says
        fsdp_plugin=fsdp_plugin() if cfg.fsdp else None,
        log_with=cfg.track,
        project_config=ProjectConfiguration(project_dir=cfg.track_dir, logging_dir=cfg.track_dir),
    )
    if accelerator.num_processes > 1 and cfg.device not in (None, "cpu"):
        raise ValueError(f"device={cfg.device} under {accelerator.num_processes} processes: each process uses its "
                         "own device; leave device unset (or cpu)")
    return accelerator


def check_launcher(cfg) -> None:
    """The config owns precision, accumulation and FSDP (the manifest records it). accelerate would take them
    from ``accelerate launch`` flags or an ``accelerate config`` default instead, so one that asks for another
    value is an error rather than silently winning or losing."""
    env = os.environ
    asked = {
        "mixed_precision": env.get("ACCELERATE_MIXED_PRECISION", cfg.mixed_precision).lower(),
        "fsdp": env.get("ACCELERATE_USE_FSDP", str(cfg.fsdp)).lower() == "true",
        "optim.gradient_accumulation_steps": int(env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                                                         cfg.optim.gradient_accumulation_steps)),
    }
    ours = {"mixed_precision": cfg.mixed_precision, "fsdp": cfg.fsdp,
            "optim.gradient_accumulation_steps": cfg.optim.gradient_accumulation_steps}
    differ = [f"{key}={asked[key]} (the config has {ours[key]})" for key in ours if asked[key] != ours[key]]
    if differ:
        raise ValueError(f"accelerate launch asks for {', '.join(differ)}: set it in the training config "
                         "(the manifest records the config) and launch without that flag")


def fsdp_plugin() -> FullyShardedDataParallelPlugin:
    """FSDP2: every decoder layer (the base model's ``_no_split_modules``) its own shard unit; full state dicts
    gathered for saving, so the artifact is the same PEFT + head files as under DDP."""
    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                          state_dict_type="FULL_STATE_DICT", reshard_after_forward=True)


def process_device(cfg, accelerator: Accelerator) -> str | None:
    """Where this process loads the base model: the configured device for one process, the process's own device
    under DDP, the CPU under FSDP (fully_shard moves each process's shard to its GPU)."""
    if accelerator.num_processes == 1:
        return cfg.device
    if accelerator.distributed_type == DistributedType.FSDP:
        return "cpu"
    return str(accelerator.device)


class OptionScorer(torch.nn.Module):
    """Trunk (the LoRA-wrapped base model) and option head as one module: what ``accelerator.prepare`` wraps in
    DDP or FSDP, so that LoRA and head gradients are averaged across processes together.

    The head runs with autocast off: under bf16/fp16 mixed precision the trunk's matmuls are half precision,
    the head's evidence, digamma/lgamma and the losses stay in float32.
    """

    def __init__(self, predictor: Predictor) -> None:
        super().__init__()
        self.model = predictor.model
        self.head = predictor.head
        self.predictor = predictor  # not a module: its hidden() runs the trunk registered above
        self._no_split_modules = getattr(predictor.model, "_no_split_modules", None)  # FSDP's auto wrap reads it

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, last_index: torch.Tensor,
                option_mask: torch.Tensor) -> HeadPrediction:
        """input_ids, attention_mask: (B, S); last_index: (B,); option_mask: (B, C) -> head outputs over C options."""
        hidden = self.predictor.hidden(EncodedBatch(input_ids, attention_mask, last_index, option_mask))
        with torch.autocast(hidden.device.type, enabled=False):
            return self.head(hidden, option_mask.to(hidden.device))


def flatten(values: dict, sep: str = "/", prefix: str = "") -> dict:
    """Nested dict -> one level with joined keys; numbers, strings and booleans kept, anything else as JSON text
    (TensorBoard's hyper-parameters and MLflow's params take scalars only)."""
    flat = {}
    for key, value in values.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, dict):
            flat.update(flatten(value, sep, name))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value)
    return flat


def numbers(values: dict) -> dict:
    """The int and float entries of a flat dict (what a tracker logs as scalars)."""
    return {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


__all__ = ["OptionScorer", "make_accelerator", "check_launcher", "fsdp_plugin", "process_device", "flatten",
           "numbers"]
