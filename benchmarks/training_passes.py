"""What the training benchmarks share: the recipe's loss on a batch with its random draws fixed, one timed forward and
backward pass of it, and batches of SciQ training questions grouped by length as training groups them
(benchmarks.gradient_checkpointing, benchmarks.training_precision)."""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

RECIPE = "ibedl/training/configs/smollm2_science_ib_edl.yaml"


def add_arguments(parser: argparse.ArgumentParser, benchmark: str, steps: int, each: str) -> None:
    """The arguments every training-pass benchmark takes: the recipe, the device, the batch, how many batches (each
    run ``each``) and where the result goes (default ``benchmarks/results/<benchmark>_<device>.json``)."""
    parser.add_argument("--config", default=RECIPE, help="the training recipe whose model, LoRA, head and loss run")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="questions a pass (default: the recipe's micro-batch, optim.batch_size)")
    parser.add_argument("--steps", type=int, default=steps, help=f"batches, each run {each}; >= 2")
    parser.add_argument("--output", default=None, help=f"default: benchmarks/results/{benchmark}_<device>.json")


def check_arguments(parser: argparse.ArgumentParser, args) -> None:
    """Refuse (``parser.error``, naming the value) a batch below 1, fewer than 2 batches or a device not cpu or cuda."""
    if (args.batch_size is not None and args.batch_size < 1) or args.steps < 2:
        parser.error(f"--batch-size must be >= 1 and --steps >= 2, got {args.batch_size} and {args.steps}")
    if args.device not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")


def loss_of(scorer, method, params, enc, y, seed: int, autocast=contextlib.nullcontext) -> torch.Tensor:
    """The method's training loss on ``enc`` (a forward pass, under ``autocast()`` as accelerate runs the model's
    forward in mixed precision; the loss outside it), its random draws (dropout's masks, the loss's samples) fixed by
    ``seed``."""
    from ibedl.training.methods.base import LossContext

    device = enc.input_ids.device
    torch.manual_seed(seed)
    context = LossContext(generator=torch.Generator(device=device).manual_seed(seed))
    with autocast():
        out = scorer(enc.input_ids, enc.attention_mask, enc.last_index, enc.option_mask)
    return method.loss(out, y, enc.option_mask, params, context)["loss"].mean()


def one_pass(scorer, method, params, enc, y, seed: int, autocast=contextlib.nullcontext) -> tuple[float, list]:
    """(seconds, gradients) of one forward and backward pass of the method's loss on ``enc``, the model's forward
    under ``autocast()`` (none by default); on CUDA the peak of allocated memory is reset first."""
    device = enc.input_ids.device
    trained = [p for p in scorer.parameters() if p.requires_grad]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    loss_of(scorer, method, params, enc, y, seed, autocast).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    grads = [p.grad.detach().clone() for p in trained]
    for p in trained:
        p.grad = None
    return seconds, grads


def training_batches(batch_size: int, steps: int) -> list:
    """``steps`` batches of SciQ training questions with passages, grouped by length as training groups them
    (``finetune.length_grouped_batches`` over a window of 32 batches), so they hold a training batch's padding."""
    import random

    from ibedl.training.data import load_dataset
    from ibedl.training.finetune import length_grouped_batches

    need = max(32, steps) * batch_size
    pool = [q for q in load_dataset("sciq", "train", seed=0) if q.context][:need]
    if len(pool) < need:
        raise ValueError(f"{len(pool)} SciQ training questions with passages, {need} needed")
    return [[pool[i] for i in b] for b in length_grouped_batches(pool, batch_size, random.Random(0))[:steps]]
