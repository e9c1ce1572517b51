"""What gradient checkpointing (the training config's ``gradient_checkpointing: true``) trades, on this machine's CPU
or a CUDA GPU: the activations a training step keeps against the time it takes.

    python -m benchmarks.gradient_checkpointing [--config ibedl/training/configs/smollm2_science_ib_edl.yaml]
        [--device cpu] [--batch-size N] [--steps 8] [--output benchmarks/results/gradient_checkpointing_cpu.json]

The recipe's model, LoRA and head (``finetune.build``) run the forward and backward pass of its training loss on
batches of distinct SciQ training questions with their passages, grouped by length as training groups them, each
batch twice: checkpointing off and on (off first, then on first, ...), from the same weights (no optimizer step) and
the same random state (dropout masks, the loss's samples), after one untimed pass of each. Recorded per setting:
step seconds, the bytes autograd keeps for the backward pass (its saved tensors, weights left out, counted in a
forward pass of their own, untimed: ``benchmarks.common.saved_activation_bytes``) and, on CUDA, the peak of
allocated memory;
``on_vs_off`` gives the time ratio with a 95% paired bootstrap interval over the batches and the kept bytes' ratio;
``gradient_max_rel_diff`` the largest difference between the two settings' gradients over the largest gradient
(checkpointing recomputes the same arithmetic: it should be 0 on a CPU, or float noise). The CPU's features or the
GPU's name are recorded.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import training_passes
from benchmarks.common import cpu_features, device_output, paired_ratio, saved_activation_bytes, write_result
from benchmarks.training_passes import loss_of, one_pass, training_batches
from ibedl.training.finetune import enable_gradient_checkpointing

SETTINGS = ("off", "on")


def kept_bytes(scorer, method, params, enc, y, seed: int) -> int:
    """The bytes autograd keeps for the backward pass of that loss: a forward pass of its own, untimed (counting
    runs a Python hook per saved tensor)."""
    return saved_activation_bytes(lambda: loss_of(scorer, method, params, enc, y, seed), scorer)[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    training_passes.add_arguments(parser, "gradient_checkpointing", steps=8, each="in both settings")
    args = parser.parse_args(argv)
    training_passes.check_arguments(parser, args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    from ibedl.training.config import load_config
    from ibedl.training.distributed import OptionScorer
    from ibedl.training.finetune import build
    from ibedl.training.methods import METHODS

    cfg = load_config(args.config, [f"device={args.device}", "progress=false"])
    args.batch_size = args.batch_size or cfg.optim.batch_size
    try:  # before the model: a request the data cannot meet is refused at once
        batches = training_batches(args.batch_size, args.steps)
    except ValueError as e:
        parser.error(f"--batch-size {args.batch_size} --steps {args.steps}: {e}")
    method = METHODS[cfg.method]
    predictor, _, _, params, _ = build(cfg, method)
    scorer = OptionScorer(predictor).train()
    warm = predictor.encode(batches[0]).to(args.device)
    for setting in SETTINGS:  # one untimed pass of each: first-call costs (allocations, kernels chosen) fall here
        enable_gradient_checkpointing(predictor.model, setting == "on")
        one_pass(scorer, method, params, warm, torch.tensor([q.answer for q in batches[0]], device=args.device), 0)
    seconds, kept, peaks = ({s: [] for s in SETTINGS} for _ in range(3))
    worst, tokens, padded = 0.0, [], []
    for i, batch in enumerate(batches):
        enc = predictor.encode(batch).to(args.device)
        tokens.append(int(enc.attention_mask.sum()))
        padded.append(enc.input_ids.numel())
        y = torch.tensor([q.answer for q in batch], device=args.device)
        grads = {}
        for setting in SETTINGS if i % 2 == 0 else SETTINGS[::-1]:
            enable_gradient_checkpointing(predictor.model, setting == "on")
            s, grads[setting] = one_pass(scorer, method, params, enc, y, seed=i)
            seconds[setting].append(s)
            if args.device == "cuda":
                peaks[setting].append(torch.cuda.max_memory_allocated())
            kept[setting].append(kept_bytes(scorer, method, params, enc, y, seed=i))
        scale = max(float(g.abs().max()) for g in grads["off"])
        worst = max(worst, max(float((a - b).abs().max()) for a, b in zip(grads["on"], grads["off"], strict=True))
                    / scale)
        print(f"batch {i + 1}/{len(batches)}: off {seconds['off'][-1]:.2f} s, on {seconds['on'][-1]:.2f} s", flush=True)
    mib = 2**20
    result = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "cpu": cpu_features() if args.device == "cpu" else None, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "config": args.config, "method": cfg.method,
        "dtype": str(next(predictor.model.parameters()).dtype), "batch_size": args.batch_size,
        "batches": len(batches), "mean_prompt_tokens": sum(tokens) / sum(map(len, batches)),
        "mean_padded_tokens": sum(padded) / sum(map(len, batches)),  # per question, batched as training batches
        "settings": {s: {"mean_step_s": sum(seconds[s]) / len(seconds[s]),
                         "mean_kept_activation_mib": sum(kept[s]) / len(kept[s]) / mib,
                         "peak_allocated_mib": max(peaks[s]) / mib if peaks[s] else None} for s in SETTINGS},
        "on_vs_off": {"step_time": paired_ratio(seconds["on"], seconds["off"]),
                      "kept_activations": sum(kept["on"]) / sum(kept["off"]),
                      "peak_allocated": max(peaks["on"]) / max(peaks["off"]) if peaks["on"] else None},
        "gradient_max_rel_diff": worst,
    }
    write_result(args.output or device_output("gradient_checkpointing", args.device), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
