"""Fine-tune a LoRA adapter and an option head with one of the registry's methods; write an artifact.

    python -m ibedl.training.finetune --config ibedl/training/configs/smollm2_science_ib_edl.yaml [key.sub=value ...]
    accelerate launch --multi_gpu --num_processes 4 -m ibedl.training.finetune --config ...
        (multi-GPU: ibedl.training.distributed)

The loop is written out (no Trainer) on an accelerate Accelerator (DDP/FSDP, gradient accumulation,
autocast): seeded data order, AdamW with warmup + cosine decay, gradient clipping, a progress bar with loss
and throughput, periodic validation, then the artifact: PEFT files, head safetensors and a manifest with
validation/test metrics, abstention thresholds and a drift reference sample.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shlex
import shutil
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from itertools import pairwise
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm import tqdm

from ibedl.core import prefix_cache
from ibedl.core.artifact import PEFT_TASK_TYPE, Manifest, files_sha256, save_head, write_manifest
from ibedl.core.base_model import ResolvedModel, check_device, load_base_model, resolve_model
from ibedl.core.cpu_isa import describe_device
from ibedl.core.head import HEADS, CentredEvidence, HeadConfig, build_head
from ibedl.core.model_card import write_card
from ibedl.core.predictor import Predictor, fits, lm_head_rows
from ibedl.core.prompt import MCQuestion, option_token_ids
from ibedl.training import member_resume, warm_start
from ibedl.training.calibrate import CalibrationConfig, apply_sections, calibrate_predictor
from ibedl.training.config import TRACKERS, DataPart, TrainConfig, config_keys_help, load_config
from ibedl.training.distributed import (
    OptionScorer,
    flatten,
    make_accelerator,
    numbers,
    process_device,
    reset_accelerator,
)
from ibedl.training.evaluate import evaluate
from ibedl.training.methods import LossContext, Method, get_method
from ibedl.training.metrics import summarise

log = logging.getLogger("ibedl.training.finetune")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def subset_seed(cfg: TrainConfig) -> int:
    """The seed that picks the training subsets: ``data.subset_seed``, else the run's seed."""
    return cfg.seed if cfg.data.subset_seed is None else cfg.data.subset_seed


def load_parts(parts: list[DataPart], role: str, cfg: TrainConfig | None = None) -> list[MCQuestion]:
    """The questions of ``parts`` for ``role``: training subsets drawn with the run's seed and label noise (``cfg``
    required), validation and test subsets with seed 0 and clean labels."""
    from ibedl.training.data import load_dataset

    if role == "train" and cfg is None:
        raise ValueError("training parts need the run's config (subset seed, label noise)")
    train = role == "train"
    # a start's training questions, left out of the draw (data.disjoint_from)
    seen = start_training_ids(cfg.data.disjoint_from) if train and cfg.data.disjoint_from else frozenset()
    questions: list[MCQuestion] = []
    for part in parts:
        questions += load_dataset(
            part.dataset,
            part.split or role,
            path=part.path,
            limit=part.limit,
            seed=subset_seed(cfg) if train else 0,
            label_noise=cfg.data.label_noise if train else 0.0,
            noise_seed=cfg.data.noise_seed if train else 0,
            exclude=seen,
        )
    return questions


def start_training_ids(artifact: str | Path) -> frozenset[str]:
    """The ids of the training questions the artifact at ``artifact`` drew, as its manifest's training config drew
    them (those it then dropped as too long included): what a run that starts from it may have seen."""
    training = json.loads((Path(artifact) / "manifest.json").read_text()).get("training") or {}
    if "config" not in training:
        raise ValueError(f"{artifact}: its manifest has no training.config, so its training questions are unknown")
    cfg = TrainConfig(**training["config"])
    return frozenset(q.id for q in load_parts(cfg.data.train, "train", cfg))


def start_overlap(cfg: TrainConfig, train_q: list[MCQuestion]) -> dict | None:
    """How many of the run's training questions its start (``init_from``) drew for its own training; None without
    a start."""
    if not cfg.init_from:
        return None
    seen = start_training_ids(cfg.init_from)
    return {"start": str(cfg.init_from), "questions": len(train_q),
            "seen_by_start": sum(q.id in seen for q in train_q), "disjoint_from": cfg.data.disjoint_from}


def run_questions(training: dict) -> tuple[TrainConfig, list[MCQuestion], list[MCQuestion]]:
    """A trained run's config and its training and validation questions, from its manifest's ``training`` section:
    drawn with the run's seeds and label noise, those too long for ``max_tokens`` left out, as when it trained."""
    cfg = TrainConfig(**training["config"])
    train_q = load_parts(cfg.data.train, "train", cfg)
    val_q = load_parts(cfg.data.validation, "validation", cfg)
    train_q, val_q, _, _ = drop_unfit(cfg, train_q, val_q, [])
    return cfg, train_q, val_q


def predictive_fit_questions(method: Method, params: dict, train_q: list[MCQuestion], seed: int) -> list[MCQuestion]:
    """The training questions a method's predictive is fitted on: ``num_samples`` of them drawn with ``seed``."""
    return random.Random(seed).sample(train_q, min(method.predictive_fit.num_samples(params), len(train_q)))


def length_grouped_batches(
    questions: list[MCQuestion], batch_size: int, rng: random.Random, group: int = 32
) -> list[list[int]]:
    """Shuffled batches of indices; within windows of ``group`` batches, similar lengths go together
    (less padding on long-context data, still a random order)."""
    order = list(range(len(questions)))
    rng.shuffle(order)
    size = lambda i: len(questions[i].context or "") + len(questions[i].question) + sum(map(len, questions[i].options))  # noqa: E731
    window = batch_size * group
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=size)
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def micro_batches(idx: list[int], parts: int) -> list[list[int]]:
    """One optimizer step's questions in ``parts`` contiguous near-equal micro-batches (gradient accumulation), so
    a step sees the same questions whatever it is split into; a part left empty (a step shorter than ``parts``,
    at the end of an epoch) repeats the step's last question."""
    size, extra = divmod(len(idx), parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [idx[a:b] or idx[-1:] for a, b in pairwise(bounds)]


def lr_lambda(schedule: str, total: int, warmup: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
        return 1.0 - frac if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))

    return f


def build(cfg: TrainConfig, method: Method, device: str | None = None, resolved: ResolvedModel | None = None,
          tokenizer=None):
    """Base model with LoRA, the method's head initialised from the LM head's option rows, a Predictor; loaded
    on ``device`` (default ``cfg.device``). ``resolved`` and ``tokenizer``: the base model as :func:`train` resolved
    it and its tokenizer (default: resolved and loaded here)."""
    from peft import LoraConfig, get_peft_model

    if resolved is None:
        resolved = resolve_model(cfg.base_model)
    # Mixed precision keeps float32 weights and lets autocast run the matmuls in half precision.
    dtype = DTYPES[cfg.dtype] if cfg.dtype else (torch.float32 if cfg.mixed_precision != "no" else None)
    model, tokenizer = load_base_model(
        resolved, device=device or cfg.device, dtype=dtype, load_in_4bit=cfg.load_in_4bit, tokenizer=tokenizer
    )
    if next(model.parameters()).device.type == "cuda":  # not for a CPU run in a process that also has CUDA
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 training at TF32 matmul speed on Ampere+
        torch.backends.cudnn.allow_tf32 = True
    if cfg.load_in_4bit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    ids = option_token_ids(tokenizer, cfg.num_rows)
    rows = lm_head_rows(model, ids)
    source = None
    if cfg.init_from:  # warm start (ibedl.training.warm_start): the source's option rows replace the LM head's
        source = warm_start.read_source(cfg.init_from, resolved.sha256, ids, cfg.lora)
        rows = warm_start.source_rows(cfg.init_from, source).to(rows.device)
    params = method.params(cfg.method_params)
    head_config = HeadConfig(
        kind=method.head,
        num_rows=cfg.num_rows,
        hidden_size=rows.shape[1],
        offset=method.offset(params),
        centre_options=cfg.centre_options,
        evidence_scale=cfg.evidence_scale,
        centre_sigma=cfg.centre_options and HEADS[method.head].has_sigma,
        **(method.head_options(params) if method.head_options else {}),
    )
    head = build_head(head_config, rows).to(model.device)
    lora = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=list(cfg.lora.targets), bias="none", task_type=PEFT_TASK_TYPE)
    model = get_peft_model(model, lora)  # adapter_config.json names the base by resolved.ref (load_base_model)
    warm = None
    if source is not None:
        same_kind = source.head_config().kind == head_config.kind
        if same_kind:
            warm_start.load_head_tensors(head, cfg.init_from)
        warm = {"path": str(cfg.init_from), "name": source.name, "version": source.version, "method": source.method,
                "lora_tensors": warm_start.load_lora(model, cfg.init_from), "head": "all" if same_kind else "rows"}
        log.info("warm start from %s (%s): LoRA and head %s", cfg.init_from, source.method, warm["head"])
    predictor = Predictor(model, tokenizer, head, template=cfg.template, max_tokens=cfg.max_tokens)
    if cfg.train_layers is not None:  # only the top layers learn: freeze the rest and read their output from the cache
        frozen = prefix_cache.freeze_below(model, prefix_cache.check_train_layers(model, cfg.train_layers))
        prefix_cache.attach(predictor, cfg.train_layers, resolved.sha256)
        log.info("train_layers %d: %d LoRA tensors below frozen", cfg.train_layers, frozen)
    if cfg.gradient_checkpointing:  # opt-in (TrainConfig.gradient_checkpointing); acts in train mode only
        enable_gradient_checkpointing(model)
    if cfg.torch_compile:  # opt-in (TrainConfig.torch_compile); the adapter saved is the uncompiled module's
        predictor.decoder = torch.compile(predictor.decoder, dynamic=True)
    return predictor, resolved, ids, params, warm


def enable_gradient_checkpointing(model, on: bool = True) -> None:
    """Each decoder layer of ``model`` (PEFT-wrapped or not) recomputes its activations in the backward pass instead
    of keeping them (``on``; False: keeps them again): transformers' checkpointing, non-reentrant
    (torch.utils.checkpoint's recommended form), which replays dropout's random state, so the gradients are those of
    the plain step. Only in train mode: evaluation and serving run as before. transformers 5.2x names it
    ``activation_checkpointing_*``, earlier releases ``gradient_checkpointing_*``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(base).__name__} does not support gradient checkpointing")
    new = hasattr(base, "activation_checkpointing_enable")
    if not on:
        (base.activation_checkpointing_disable if new else base.gradient_checkpointing_disable)()
        return
    if new:
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Enabling also hooks the input embeddings so that their output requires a gradient, which only reentrant
    # checkpointing needs: kept, the backward pass would run on into the frozen embeddings' output, and turning
    # checkpointing off would leave the hook behind.
    if hasattr(base, "disable_input_require_grads"):
        base.disable_input_require_grads()


def base_tokenizer(resolved: ResolvedModel):
    """The tokenizer of a resolved base model (what load_base_model loads beside the weights)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolved.path)


def drop_unfit(cfg: TrainConfig, train_q, val_q, test_q, tokenizer=None):
    """Leave out questions whose prompt exceeds max_tokens even without their passage (logged and counted).
    ``tokenizer``: the base model's (default: loaded from ``cfg.base_model``)."""
    if tokenizer is None:
        tokenizer = base_tokenizer(resolve_model(cfg.base_model))
    kept, dropped = [], {}
    for role, questions in (("train", train_q), ("validation", val_q), ("test", test_q)):
        fit = [q for q in questions if fits(tokenizer, cfg.template, cfg.max_tokens, q)]
        dropped[role] = len(questions) - len(fit)
        if dropped[role]:
            log.warning("%d %s questions do not fit max_tokens=%d even without a passage; left out",
                        dropped[role], role, cfg.max_tokens)
        kept.append(fit)
    if not kept[0] or not kept[1]:
        raise ValueError(f"no training or validation question fits max_tokens={cfg.max_tokens}")
    return (*kept, dropped)


def make_optimizer(cfg: TrainConfig, model, head) -> tuple[torch.optim.Optimizer, int]:
    """(AdamW over the LoRA weights at ``optim.lr`` and the head at ``optim.head_lr``, the trainable parameter
    count); the evidence bias stays frozen unless ``train_evidence_bias``."""
    lora_params = [p for p in model.parameters() if p.requires_grad]
    if not cfg.train_evidence_bias and isinstance(head, CentredEvidence):
        getattr(head, head.bias_name).requires_grad_(False)
    method = get_method(cfg.method)
    params = method.params(cfg.method_params)
    for name in method.frozen(params) if method.frozen else ():
        getattr(head, name).requires_grad_(False)  # an ablation: kept at its initialisation
    head_lr = cfg.optim.head_lr or cfg.optim.lr
    scales = method.lr_scales(params) if method.lr_scales else {}
    by_scale: dict[float, list] = {}  # the head's parameters grouped by their learning-rate factor
    for name, p in head.named_parameters():
        if p.requires_grad:
            by_scale.setdefault(float(scales.get(name, 1.0)), []).append(p)
    groups = [{"params": lora_params}, {"params": by_scale.pop(1.0, []), "lr": head_lr}]
    groups += [{"params": ps, "lr": head_lr * scale} for scale, ps in sorted(by_scale.items())]
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    head_params = [p for g in groups[1:] for p in g["params"]]
    return optimizer, sum(p.numel() for p in lora_params + head_params)


def centre_evidence(cfg: TrainConfig, predictor, train_q, rng: random.Random) -> None:
    """Centre the head's pre-evidence on 16 training questions (the letter logits start near +17; see
    EvidentialHead), shifted by ``evidence_bias`` when it is a number."""
    model, head = predictor.model, predictor.head
    with torch.no_grad():
        model.eval()
        probe = [train_q[i] for i in rng.sample(range(len(train_q)), min(16, len(train_q)))]
        enc = predictor.encode(probe)
        bias = head.init_bias_from(predictor.hidden(enc), enc.option_mask.to(model.device))
        if cfg.evidence_bias != "center":
            bias = head.set_bias(bias + float(cfg.evidence_bias))
        log.info("head bias initialised to %.3f", bias)


def fit_member(cfg: TrainConfig, method: Method, params: dict, train_q, val_q, member_dir: Path, seed: int,
               history_path: Path, member: int, accelerator: Accelerator, resolved: ResolvedModel | None = None,
               tokenizer=None) -> dict:
    """Train one adapter + head (one ensemble member, or the only one) and save it into ``member_dir``.

    Every process runs this. A step draws processes x batch_size x gradient_accumulation_steps questions (the
    batch one process with that batch size would draw), splits them into micro-batches and each micro-batch
    between the processes (ibedl.training.distributed). ``resolved``, ``tokenizer``: see :func:`build`.
    """
    set_seed(seed)
    predictor, resolved, ids, _, warm = build(cfg, method, device=process_device(cfg, accelerator),
                                              resolved=resolved, tokenizer=tokenizer)
    model, head = predictor.model, predictor.head
    rng = random.Random(seed)
    accumulation = cfg.optim.gradient_accumulation_steps
    global_batch = cfg.optim.batch_size * accelerator.num_processes * accumulation  # questions per optimizer step
    steps_per_epoch = math.ceil(len(train_q) / global_batch)
    total = cfg.optim.max_steps or max(1, math.ceil(steps_per_epoch * cfg.optim.epochs))
    warmup = max(1, int(cfg.optim.warmup_ratio * total))
    optimizer, trainable = make_optimizer(cfg, model, head)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim.schedule, total, warmup))
    clip = cfg.optim.clip_grad_norm if cfg.optim.clip_grad_norm is not None else method.clip_grad_norm
    log.info("method %s %s; member %d; %d trainable parameters; %d steps (warmup %d) of %d questions "
             "(%d processes x batch %d x accumulation %d)", method.name, params, member, trainable, total, warmup,
             global_batch, accelerator.num_processes, cfg.optim.batch_size, accumulation)

    def batches():
        epoch = 0
        while True:
            for b in length_grouped_batches(train_q, global_batch, rng):
                yield epoch, b
            epoch += 1

    stream = batches()
    member_path = member_dir.relative_to(history_path.parent)  # "." or members/<i>
    suffix = "" if member_path == Path(".") else f"/{member_path}"  # tracker keys: train/loss, validation/nll, ...
    if isinstance(head, CentredEvidence) and cfg.evidence_bias != "none" and not (warm and warm["head"] == "all"):
        centre_evidence(cfg, predictor, train_q, rng)
    # One process: the same module and optimizer back. Several: DDP (or FSDP) around trunk and head together.
    scorer, optimizer = accelerator.prepare(OptionScorer(predictor), optimizer)
    device = predictor.device
    if accelerator.num_processes > 1:  # each process its own dropout masks (seed + process index)
        set_seed(seed, device_specific=True)
    generator = torch.Generator(device=device).manual_seed(seed + accelerator.process_index)
    stopper = EarlyStopping(cfg.optim.patience, accelerator.unwrap_model(scorer))
    start_val = validation_metrics(predictor, val_q[: cfg.eval_limit], cfg.eval_batch_size, accelerator)
    stopper.observe(0, start_val)
    scorer.train()
    seen, running, t0 = 0, None, time.perf_counter()
    desc = f"train {method.name}" + (f" [{member}]" if member else "")
    bar = tqdm(total=total, desc=desc, unit="step", disable=not (cfg.progress and accelerator.is_main_process),
               dynamic_ncols=True)
    epochs = total / steps_per_epoch  # the epoch budget (max_steps may cut or extend optim.epochs)
    last = 0
    for step in range(total):
        epoch, idx = next(stream)
        context = LossContext(progress=step / total, epoch=epoch, epochs=epochs, generator=generator)
        stats = []
        for micro in micro_batches(idx, accumulation):
            # This process's contiguous share (padded with the last question when it does not divide evenly).
            with accelerator.split_between_processes(micro, apply_padding=True) as share:
                batch_q = [train_q[i] for i in share]
            with accelerator.accumulate(scorer):
                enc = predictor.encode(batch_q).to(device)
                y = torch.tensor([q.answer for q in batch_q], device=device)
                out = scorer(enc.input_ids, enc.attention_mask, enc.last_index, enc.option_mask)
                parts = method.loss(out, y, enc.option_mask, params, context)
                loss = parts["loss"].mean()
                stats.append(accelerator.reduce(step_stats(loss, parts, out, y), "mean"))  # the global batch's means
                if not torch.isfinite(stats[-1][0]):
                    raise FloatingPointError(
                        f"loss is {stats[-1][0].item()} at step {step + 1}; lower optim.lr or check the data"
                    )
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(scorer.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        seen += len(idx)
        lr = scheduler.get_last_lr()[0]  # the rate this step used, before the schedule moves to the next
        if not accelerator.optimizer_step_was_skipped:  # fp16: a step with inf gradients is skipped
            scheduler.step()
        values = dict(zip(stat_names(parts, out), torch.stack(stats).mean(0).tolist(), strict=False))
        running = values["loss"] if running is None else 0.95 * running + 0.05 * values["loss"]
        rate = seen / (time.perf_counter() - t0)
        bar.set_postfix(loss=f"{running:.4f}", samples_s=f"{rate:.2f}", epoch=epoch)
        bar.update(1)
        record = {"member": member, "step": step + 1, "epoch": epoch, "loss": values.pop("loss"),
                  "lr": lr, "grad_norm": float(grad_norm), **values}
        last = step + 1
        if validation_due(cfg, step + 1, total, steps_per_epoch):
            record["validation"] = validation_metrics(
                predictor, val_q[: cfg.eval_limit], cfg.eval_batch_size, accelerator
            )
            if accelerator.is_main_process:
                tqdm.write(
                    f"step {step + 1}: validation " + " ".join(f"{k} {v:.4f}" for k, v in record["validation"].items())
                )
            stopper.observe(step + 1, record["validation"])
            scorer.train()
        if accelerator.is_main_process:
            with history_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        scalars = {f"train{suffix}": {k: v for k, v in record.items() if k not in ("member", "step", "validation")},
                   f"validation{suffix}": record.get("validation", {})}
        accelerator.log(numbers(flatten(scalars)), step=step + 1)
        if stopper.should_stop:
            log.info("early stopping at step %d: no lower validation NLL for %d passes; keeping step %d",
                     step + 1, stopper.patience, stopper.best_step)
            break
    bar.close()
    seconds = time.perf_counter() - t0
    stopper.restore()
    end_val = stopper.best_metrics if stopper.active else validation_metrics(
        predictor, val_q[: cfg.eval_limit], cfg.eval_batch_size, accelerator)
    stopping = {"validation_start": start_val, "validation_end": end_val,
                "best_step": stopper.best_step if stopper.active else last, "stopped_step": last,
                "stopped_by": "patience" if stopper.should_stop else "budget", "budget_steps": total}
    save_member(accelerator, scorer, member_dir)
    accelerator.free_memory()  # the accelerator lets go of this member's model and optimizer
    return {"seconds": seconds, "samples": seen, "steps": last, "samples_per_s": seen / seconds, **stopping,
            "trainable_parameters": trainable, "seed": seed, "processes": accelerator.num_processes,
            "global_batch_size": global_batch, "resolved": resolved, "ids": ids,
            "head": head.config.to_dict(), "device": str(predictor.device),
            "machine": describe_device(predictor.device), "init_from": warm}


VALIDATION_KEYS = ("accuracy", "mean_confidence", "ece", "nll", "brier")


def validation_metrics(predictor: Predictor, questions: list[MCQuestion], batch_size: int, accelerator) -> dict:
    """Accuracy, mean confidence, ECE, NLL and Brier of the model as it is now on ``questions``."""
    val = evaluate(predictor, questions, batch_size, progress=False, accelerator=accelerator)
    return {k: val.metrics[k] for k in VALIDATION_KEYS}


def validation_due(cfg: TrainConfig, step: int, total: int, steps_per_epoch: int) -> bool:
    """Whether a validation pass follows optimizer step ``step`` (1-based): every ``eval_every`` steps (the last
    step's is the end's own validation), else, with early stopping, at each epoch's end; with early stopping always
    at the budget's end, or the steps after the last pass would be trained and never kept."""
    if cfg.optim.patience and step == total:
        return True
    if cfg.eval_every:
        return step % cfg.eval_every == 0 and step < total
    return bool(cfg.optim.patience) and step % steps_per_epoch == 0


class EarlyStopping:
    """Keeps the trainable parameters of the pass with the lowest validation NLL; ``should_stop`` after ``patience``
    passes without a lower one. Inactive (``patience`` None): observes nothing, restores nothing."""

    def __init__(self, patience: int | None, module: torch.nn.Module) -> None:
        self.patience = patience
        self.module = module
        self.best_nll = float("inf")
        self.best_step = 0
        self.best_metrics: dict | None = None
        self.best_state: dict[str, torch.Tensor] | None = None
        self.waited = 0

    @property
    def active(self) -> bool:
        return self.patience is not None

    @property
    def should_stop(self) -> bool:
        return self.active and self.waited >= self.patience

    def observe(self, step: int, metrics: dict) -> None:
        """A validation pass after ``step`` optimizer steps (0: the start)."""
        if not self.active:
            return
        if metrics["nll"] < self.best_nll:
            self.best_nll, self.best_step, self.best_metrics, self.waited = metrics["nll"], step, dict(metrics), 0
            self.best_state = {n: p.detach().clone() for n, p in self.module.named_parameters() if p.requires_grad}
        else:
            self.waited += 1

    @torch.no_grad()
    def restore(self) -> None:
        """Put the best pass's parameters back (nothing to do when the last pass was the best)."""
        if not self.active or self.best_state is None:
            return
        for name, param in self.module.named_parameters():
            if name in self.best_state:
                param.copy_(self.best_state[name])


def step_stats(loss: torch.Tensor, parts: dict, out, y: torch.Tensor) -> torch.Tensor:
    """(K,) float32 statistics of one batch, in the order of :func:`stat_names`: loss, batch accuracy, the loss's
    other parts, and for Dirichlet heads the mean strength and uncertainty (inflation: strength up, u down;
    collapse: alpha -> 1)."""
    values = [loss.detach(), (out.probs.argmax(-1) == y).float().mean()]
    values += [v.detach().mean() for k, v in parts.items() if k != "loss"]
    if out.alpha is not None:
        values += [out.alpha.detach().sum(-1).mean(), out.uncertainty.detach().mean()]
    return torch.stack([v.float() for v in values])


def stat_names(parts: dict, out) -> list[str]:
    return ["loss", "batch_accuracy", *(k for k in parts if k != "loss"),
            *(("strength", "uncertainty") if out.alpha is not None else ())]


def save_member(accelerator: Accelerator, scorer: torch.nn.Module, member_dir: Path) -> None:
    """PEFT adapter files and head safetensors, written by the main process. Every process takes part in
    ``get_state_dict`` (under FSDP it gathers the shards); under DDP and one process it is the module's own."""
    state = accelerator.get_state_dict(scorer)
    if accelerator.is_main_process:
        scorer = accelerator.unwrap_model(scorer)
        member_dir.mkdir(parents=True, exist_ok=True)
        # save_embedding_layers=False: the base's embeddings are not trained, and PEFT would otherwise ask the Hub
        # whether the base reference names a repo there (a network timeout on an offline machine)
        scorer.model.save_pretrained(member_dir, safe_serialization=True, state_dict=_part(state, "model."),
                                     save_embedding_layers=False)
        save_head(member_dir, scorer.head, state_dict=_part(state, "head."))


def _part(state: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def ceiling(method: str, params: dict, train_q: list[MCQuestion]) -> dict | None:
    """The method's confidence ceiling (IB-EDL's, ibedl.training.confidence_ceiling) at the training data's most
    common option count; None for a method without one."""
    record = get_method(method)
    if record.confidence_ceiling is None:
        return None
    counts = Counter(len(q.options) for q in train_q)
    result = record.confidence_ceiling(params, counts.most_common(1)[0][0])
    if result is not None:
        log.info("%s confidence ceiling: %.3f (%d options)", record.label, result["confidence"], result["num_options"])
    return result


def train(cfg: TrainConfig, command: str = "") -> Path:
    """Run one fine-tuning job (M jobs for an ensemble, then the method's predictive fit if it has one);
    returns the artifact directory.

    Metrics, zeta and thresholds are computed on the artifact as saved and reloaded, so what is
    measured is exactly what the service will load. Under several processes (``accelerate launch``) all of
    them train; the main process alone then calibrates, evaluates and writes the manifest, so every method
    runs there as it does in one process (Laplace's predictive fit included). An ensemble started again after an
    interruption keeps the members the interrupted start had saved under the same config
    (:mod:`ibedl.training.member_resume`), copies those a run in ``members_from`` trained (MAP's run of its seed
    is its first member) and trains the rest.
    """
    method = get_method(cfg.method)
    params = method.params(cfg.method_params)
    dirs = member_dirs(method, params)
    check_members_from(cfg, len(dirs))
    check_device(cfg.device)
    out_dir = Path(cfg.output).resolve()
    if int(os.environ.get("RANK", "0")) == 0:  # one process (accelerate launch numbers them) touches the output
        settle(out_dir)  # a publish cut short by an earlier start: finished or undone, before anything is decided
    check_output(out_dir)
    stage = staging_dir(out_dir)  # the run writes here; the artifact replaces out_dir only once complete
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    accelerator = make_accelerator(cfg)
    if cfg.track:
        accelerator.init_trackers(cfg.name, config=flatten(cfg.to_dict(), sep="."))
    started = time.time()
    train_q, val_q, test_q = load_splits(cfg)
    # The base model is resolved (its weights hashed) and its tokenizer loaded once per process, then passed down.
    with accelerator.main_process_first():  # one process converts a base model the cache lacks; the others reuse it
        resolved = resolve_model(cfg.base_model)
    tokenizer = base_tokenizer(resolved)
    train_q, val_q, test_q, dropped = drop_unfit(cfg, train_q, val_q, test_q, tokenizer)
    seeds = [cfg.seed + 1000 * i for i in range(len(dirs))]
    digests = [member_resume.fingerprint(member_config(cfg, method), seed, resolved.sha256) for seed in seeds]
    # An ensemble's members saved by an interrupted start of this run under the same config are kept, not retrained.
    resumed = {i: run for i, d in enumerate(dirs) if len(dirs) > 1
               and (run := member_resume.finished(stage / d, digests[i])) is not None}
    if accelerator.is_main_process and len(dirs) == 1:
        shutil.rmtree(stage, ignore_errors=True)  # an interrupted run's files: one adapter resumes nothing
    history_path = start_history(stage, set(resumed)) if accelerator.is_main_process else stage / "history.jsonl"
    runs = []
    for i, d in enumerate(dirs):
        if i in resumed:
            log.info("member %d: kept as an earlier start of this run saved it (%s)", i, stage / d)
            runs.append({**resumed[i], "resolved": resolved})
            continue
        if (adopted := adopt_member(cfg, stage / d, digests[i], history_path, i, accelerator)) is not None:
            runs.append({**adopted, "resolved": resolved})
            continue
        runs.append(fit_member(cfg, method, params, train_q, val_q, stage / d, seeds[i], history_path, i,
                               accelerator, resolved, tokenizer))
        if accelerator.is_main_process:
            member_resume.save(stage / d, digests[i], runs[-1])
    if accelerator.is_main_process:
        manifest = loadable_manifest(cfg, method, params, dirs, runs[0], stage)
        write_manifest(stage, manifest)  # complete enough to load; metrics follow
        predictor = load_trained(cfg, method, params, stage, train_q, val_q, resolved, tokenizer)
        sections, metrics = calibrate_and_evaluate(cfg, method, predictor, val_q, test_q)
        training = training_record(cfg, method, params, command, runs, started, sections, dropped, train_q, predictor)
        complete_manifest(manifest, predictor, sections, metrics, training)
        write_manifest(stage, manifest)
        write_card(stage, manifest)
        publish(stage, out_dir)
        if cfg.track:  # the final metrics as scalars, the manifest as text
            accelerator.log({**numbers(flatten({"final": manifest.metrics})),
                             "manifest": (out_dir / "manifest.json").read_text()}, step=runs[0]["steps"])
    accelerator.end_training()
    reset_accelerator()  # the next train() in this process may want another device or precision
    return out_dir


def member_config(cfg: TrainConfig, method: Method) -> dict:
    """The config a member of ``method`` trains under, for its fingerprint (:mod:`ibedl.training.member_resume`):
    ``cfg`` as the method its members train as (an ensemble's as MAP), with that method's parameters as validated,
    so a run of that method with the same settings and seed fingerprints the same."""
    trains_as = get_method(method.member_method) if method.member_method else method
    written = cfg.method_params if trains_as is method else {}
    return {**cfg.to_dict(), "method": trains_as.name, "method_params": trains_as.params(written)}


def check_members_from(cfg: TrainConfig, members: int) -> None:
    """ValueError when ``members_from`` is set for a run of one adapter or names a directory that does not exist."""
    if cfg.members_from and members == 1:
        raise ValueError(f"members_from is for a run of several members (an ensemble); method {cfg.method!r} trains "
                         f"one adapter, got members_from={cfg.members_from!r}")
    missing = [d for d in cfg.members_from if not Path(d).is_dir()]
    if missing:
        raise ValueError(f"members_from: no such directory {missing}")


def adopt_member(cfg: TrainConfig, member_dir: Path, digest: str, history_path: Path, member: int,
                 accelerator: Accelerator) -> dict | None:
    """The training record of the first run in ``cfg.members_from`` that trained exactly this member (fingerprint
    ``digest``), copied into ``member_dir`` (every process waits for the main one to copy it), or None."""
    for donor in map(Path, cfg.members_from):
        # the main process checks and copies it in one step (adopt checks as finished does); the others only check
        if accelerator.is_main_process:
            found = member_resume.adopt(donor, member_dir, digest, history_path, member)
        else:
            found = member_resume.finished(donor, digest)
        if found is None:
            continue
        accelerator.wait_for_everyone()
        log.info("member %d: copied from %s, which trained it (the same config, seed and base model)", member, donor)
        return found
    return None


def load_splits(cfg: TrainConfig) -> tuple[list[MCQuestion], list[MCQuestion], list[MCQuestion]]:
    """The configured train, validation and test questions (test may be empty)."""
    train_q = load_parts(cfg.data.train, "train", cfg)
    val_q = load_parts(cfg.data.validation, "validation", cfg)
    test_q = load_parts(cfg.data.test, "test", cfg) if cfg.data.test else []
    log.info("data: %d train, %d validation, %d test", len(train_q), len(val_q), len(test_q))
    warn_overlap({"train": train_q, "validation": val_q, "test": test_q})
    return train_q, val_q, test_q


def warn_overlap(splits: dict[str, list[MCQuestion]]) -> dict[tuple[str, str], int]:
    """Questions (stem, options and passage alike) that two splits share, by pair of splits, each pair logged as a
    warning: early stopping, the post-hoc fit and the calibration's guarantees assume the validation questions are
    not trained on, and the test metrics that the test questions were seen by neither."""
    keys = {name: {(q.question, q.options, q.context) for q in qs} for name, qs in splits.items()}
    shared = {}
    for a, b in (("train", "validation"), ("train", "test"), ("validation", "test")):
        if keys[a] and keys[b] and (n := len(keys[a] & keys[b])):
            shared[(a, b)] = n
            log.warning("%d of the %d %s questions are also %s questions: the %s split is not held out, and what it "
                        "measures or certifies is optimistic", n, len(keys[b]), b, a, b)
    return shared


def staging_dir(out_dir: Path) -> Path:
    """Where a run writes the artifact for ``out_dir`` until it is complete: a hidden sibling (the same file system,
    so publishing it is a rename). An interrupted run leaves it there, never a half-made artifact at ``out_dir``
    that would load; an ensemble started again resumes the members it holds."""
    out_dir = out_dir.resolve()
    return out_dir.parent / f".{out_dir.name}.partial"


def check_output(out_dir: Path) -> None:
    """ValueError, before anything is trained, when ``out_dir`` is a file, a mount point or holds the working
    directory: :func:`publish` renames it aside, which a mount point refuses (EBUSY) and which would leave the process
    in a removed directory."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"output {str(out_dir)!r} is a file, not an artifact directory")
    if out_dir.is_dir() and os.path.ismount(out_dir):
        raise ValueError(f"output {str(out_dir)!r} is a mount point, which a finished run cannot replace by a rename: "
                         "write to a directory inside it")
    if Path.cwd().resolve().is_relative_to(out_dir.resolve()):
        raise ValueError(f"output {str(out_dir)!r} holds the working directory, which a finished run replaces: run "
                         "from elsewhere")


def previous_dir(out_dir: Path) -> Path:
    """Where :func:`publish` sets the artifact it replaces aside until the new one is in place (a hidden sibling)."""
    out_dir = out_dir.resolve()
    return out_dir.parent / f".{out_dir.name}.previous"


def publish(stage: Path, out_dir: Path) -> None:
    """The completed artifact at ``stage`` put at ``out_dir`` by two renames: ``out_dir`` set aside (previous_dir),
    then ``stage`` in its place; then what else the earlier ``out_dir`` held and the new artifact does not (a caller's
    log, an earlier run's extra files) is moved back, and the rest removed. Cut short anywhere, a whole artifact is at
    ``out_dir`` or, between the renames, at the set-aside name, which the next start puts back (:func:`settle`);
    nothing is deleted before the new artifact is in place."""
    out_dir = out_dir.resolve()
    settle(out_dir)
    if out_dir.exists():
        out_dir.rename(previous_dir(out_dir))
    stage.rename(out_dir)
    settle(out_dir)
    log.info("artifact written to %s", out_dir)


def settle(out_dir: Path) -> None:
    """Finish a :func:`publish` that was cut short: with nothing at ``out_dir`` (cut between its renames) the
    set-aside artifact goes back there; else the set-aside entries ``out_dir`` lacks are moved into it and the rest
    removed. Nothing to do when nothing was set aside."""
    previous = previous_dir(out_dir)
    if not previous.is_dir():
        return
    out_dir = out_dir.resolve()
    if not out_dir.exists():
        previous.rename(out_dir)
        log.warning("%s: put back the artifact an interrupted run had set aside (%s)", out_dir, previous)
        return
    for entry in sorted(previous.iterdir()):
        if not (out_dir / entry.name).exists() and not (out_dir / entry.name).is_symlink():
            entry.rename(out_dir / entry.name)
    shutil.rmtree(previous)


def start_history(out_dir: Path, resumed: set[int] = frozenset()) -> Path:
    """Create the artifact directory and ``history.jsonl`` (one line per step, every member), keeping only the lines
    of the ``resumed`` members."""
    out_dir.mkdir(parents=True, exist_ok=True)
    history_path = out_dir / "history.jsonl"
    member_resume.keep_history(history_path, resumed)
    return history_path


def member_dirs(method: Method, params: dict) -> list[str]:
    """Adapter sub-directories: "." for a single adapter, members/<i> for an ensemble."""
    members = method.num_members(params)
    return ["."] if members == 1 else [f"members/{i}" for i in range(members)]


def loadable_manifest(cfg: TrainConfig, method: Method, params: dict, dirs: list[str], first: dict,
                      root: Path) -> Manifest:
    """The manifest of the trained members, before calibration: enough for Predictor.from_artifact, with the
    sha256 of the weight files just saved under ``root``."""
    return Manifest(
        name=cfg.name, version=cfg.version, method=method.name, method_config=params,
        base_model=first["resolved"].identity(), head=first["head"], option_token_ids=first["ids"],
        prompt={"template": cfg.template, "max_tokens": cfg.max_tokens}, members=dirs,
        mc_samples=method.num_mc_samples(params), files=files_sha256(root, dirs),
    )


def load_trained(cfg: TrainConfig, method: Method, params: dict, out_dir: Path, train_q: list[MCQuestion],
                 val_q: list[MCQuestion], resolved: ResolvedModel | None = None, tokenizer=None) -> Predictor:
    """The artifact as the service will load it, with the method's predictive fitted (e.g. Laplace:
    a posterior over the saved adapter, its prior chosen on ``val_q``, so metrics use its predictive).
    ``resolved``, ``tokenizer``: the base model as :func:`train` resolved it (default: resolved here)."""
    dtype = DTYPES[cfg.dtype] if cfg.dtype else None
    if resolved is None:
        resolved = resolve_model(cfg.base_model)
    predictor = Predictor.from_artifact(out_dir, base_model=cfg.base_model, device=cfg.device, dtype=dtype,
                                        load_in_4bit=cfg.load_in_4bit, resolved=resolved, tokenizer=tokenizer)
    prefix_cache.attach(predictor, cfg.train_layers, resolved.sha256)
    if method.predictive_fit is not None:
        fit_q = predictive_fit_questions(method, params, train_q, cfg.seed)
        log.info("predictive fit of %s on %d training questions", method.name, len(fit_q))
        predictor = method.predictive_fit.fit(predictor, fit_q, val_q, params)
    return predictor


def calibrate_and_evaluate(cfg: TrainConfig, method: Method, predictor: Predictor, val_q: list[MCQuestion],
                           test_q: list[MCQuestion]) -> tuple[dict, dict]:
    """Manifest sections from calibration and the validation (and test) metrics, in that order.

    Post-hoc step (IB-EDL's zeta), OOD gate, risk-controlled abstention, conformal sets and the drift
    reference: the same code as python -m ibedl.training.calibrate, on the validation split. The validation metrics
    are those of calibration's post-hoc outputs (one pass of the model over the validation questions).
    """
    calibration = CalibrationConfig(
        target_accuracy=cfg.target_accuracy,
        posthoc=method.calibrates_posthoc and cfg.fit_zeta,
        reference_size=cfg.reference_size,
        seed=cfg.seed,
        min_per_count=cfg.min_per_count,
    )
    sections, outputs = calibrate_predictor(predictor, val_q, calibration, cfg.eval_batch_size, progress=cfg.progress)
    val = summarise(outputs.probs, [q.answer for q in val_q], outputs.uncertainty)
    seconds = outputs.extra["seconds"]
    val["samples_per_s"] = len(val_q) / seconds if seconds > 0 else float("inf")
    test = evaluate(predictor, test_q, cfg.eval_batch_size, progress=cfg.progress, desc="test") if test_q else None
    return sections, {"validation": val, **({"test": test.metrics} if test else {})}


def run_record(runs: list[dict], started: float) -> dict:
    """Time, samples and throughput of the run (per member for an ensemble)."""
    not_run = ("resolved", "ids", "head", "init_from")  # recorded elsewhere in the manifest
    run = {k: v for k, v in runs[0].items() if k not in not_run}
    if len(runs) > 1:
        run = {"members": [{k: v for k, v in r.items() if k not in not_run} for r in runs],
               "seconds": sum(r["seconds"] for r in runs), "samples": sum(r["samples"] for r in runs),
               "samples_per_s": sum(r["samples"] for r in runs) / sum(r["seconds"] for r in runs)}
    run["wall_seconds"] = time.time() - started
    return run


def training_record(cfg: TrainConfig, method: Method, params: dict, command: str, runs: list[dict], started: float,
                    sections: dict, dropped: dict, train_q: list[MCQuestion], predictor: Predictor) -> dict:
    """The manifest's ``training`` section: how the artifact was produced."""
    run = run_record(runs, started)
    return {
        "command": command,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": cfg.to_dict(),
        "data": {role: [p.to_dict() for p in getattr(cfg.data, role)] for role in ("train", "validation", "test")},
        "label_noise": cfg.data.label_noise,
        "lora": cfg.lora.to_dict(),
        "zeta": sections["calibration"]["posthoc"] if method.calibrates_posthoc and cfg.fit_zeta else None,
        "posthoc": getattr(predictor, "predictive_fit_info", None),  # what the predictive fit chose (Laplace's prior)
        "dropped_too_long": dropped,
        "run": run,
        "confidence_ceiling": ceiling(method.name, params, train_q),
        "init_from": runs[0]["init_from"],
        "start_overlap": start_overlap(cfg, train_q),
        "device": str(predictor.device),
        "torch": torch.__version__,
    }


def complete_manifest(manifest: Manifest, predictor: Predictor, sections: dict, metrics: dict, training: dict) -> None:
    """Fill the loadable manifest's remaining sections: head as calibrated, training, metrics, calibration."""
    manifest.training = training
    manifest.metrics = metrics
    manifest.calibrated_on = predictor.calibration_key  # the backend and precision calibration ran on
    apply_sections(manifest, predictor.head.config.to_dict(), sections)
    manifest.calibration.update({"dataset": "the run's validation data", "split": "validation"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ibedl.training.finetune", description=__doc__.split("\n\n")[0],
                                     epilog=config_keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (ibedl/training/configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, values in YAML syntax")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--track", choices=TRACKERS, help="log losses, metrics and the manifest to this tracker "
                        "under track_dir (default runs/); the same as the override track=NAME")
    args = parser.parse_args(argv)
    main_process = int(os.environ.get("RANK", "0")) == 0  # accelerate launch / torchrun number the processes
    logging.basicConfig(level=logging.INFO if main_process else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides + ([f"track={args.track}"] if args.track else []))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.quiet:
        cfg.progress = False
    command = "python -m ibedl.training.finetune " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    try:
        out = train(cfg, command)
    except (ValueError, FileNotFoundError, FloatingPointError) as e:  # a NaN loss says what to change
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not main_process:
        return 0
    manifest = json.loads((out / "manifest.json").read_text())
    print(
        json.dumps(
            {"artifact": str(out), "metrics": manifest["metrics"], "abstention": manifest["abstention"]}, indent=2
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
