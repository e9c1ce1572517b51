"""What a training step costs in each precision, on this machine's CPU or a CUDA GPU, and where its time goes: why
bf16 trained slower than fp32 on the H100 (0.65x at micro-batches of 8) and the H200 (0.55x at 64).

    python -m benchmarks.training_precision [--config ibedl/training/configs/smollm2_science_ib_edl.yaml]
        [--device cpu] [--precisions fp32,bf16] [--batch-size N] [--steps 6]
        [--output benchmarks/results/training_precision_<cpu|cuda>.json]

Precisions: ``fp32`` (``dtype: float32``), ``bf16`` (``dtype: bfloat16``: the base in bfloat16, the adapter kept in
float32 by PEFT, so each LoRA layer casts its input up and its output down), and on CUDA ``bf16-autocast``
(``mixed_precision: bf16``: float32 weights, the matmuls in bfloat16 under autocast). The recipe's model, LoRA and head
(``finetune.build``, one per precision, from the recipe's warm start, so the same adapter weights) run the forward
and backward pass of its training loss on the same batches of distinct SciQ training questions with their passages,
grouped by length as training groups them; the precisions take turns in a rotating order, after one untimed pass
each. Recorded per precision: step seconds, its time against fp32's with a 95% paired bootstrap interval over the
batches, the largest difference of its gradients from fp32's over the largest gradient, on CUDA the peak of memory
allocated during a pass above what was allocated before it (every precision's model stays loaded), and one pass under
torch's profiler: the ATen operators it dispatches, the seconds of CPU time they take
against the seconds the GPU's kernels run (a step whose operators take longer to dispatch than its kernels to run is
bound by dispatching them, not by the GPU), kernel launches, the top operators and those whose calls differ most
from fp32's. Default precisions: fp32 and bf16
on a CPU, all three on CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys

import torch

from benchmarks import training_passes
from benchmarks.common import cpu_features, device_output, operator_table, paired_ratio, write_result
from benchmarks.training_passes import loss_of, one_pass, training_batches

PRECISIONS = {"fp32": ["dtype=float32"], "bf16": ["dtype=bfloat16"],
              "bf16-autocast": ["dtype=float32", "mixed_precision=bf16"]}
CUDA_ONLY = {"bf16-autocast"}  # autocast is used on CUDA only (ibedl.training.distributed)


def parse_precisions(text: str | None, device: str) -> list[str]:
    """The precisions to run (default: fp32 and bf16 on a CPU, all on CUDA), fp32 first (the others' reference);
    ValueError naming an unknown one or one this device does not run."""
    names = [p.strip() for p in (text or "").split(",") if p.strip()] or [
        p for p in PRECISIONS if device == "cuda" or p not in CUDA_ONLY]
    unknown = [p for p in names if p not in PRECISIONS]
    if unknown:
        raise ValueError(f"--precisions: unknown {unknown}; choose from {', '.join(PRECISIONS)}")
    if device != "cuda" and CUDA_ONLY & set(names):
        raise ValueError(f"--precisions: {', '.join(sorted(CUDA_ONLY & set(names)))} runs on CUDA only")
    return ["fp32", *[p for p in dict.fromkeys(names) if p != "fp32"]]


def autocast_of(precision: str, device: str):
    """The context the forward pass runs in: bf16 autocast for ``bf16-autocast``, none otherwise."""
    if precision == "bf16-autocast":
        return functools.partial(torch.autocast, device, dtype=torch.bfloat16)
    return contextlib.nullcontext


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.training_precision",
                                     description=__doc__.split("\n\n")[0])
    training_passes.add_arguments(parser, "training_precision", steps=6, each="in every precision")
    parser.add_argument("--precisions", default=None, help=f"comma-separated, of {', '.join(PRECISIONS)}")
    args = parser.parse_args(argv)
    training_passes.check_arguments(parser, args)
    try:
        precisions = parse_precisions(args.precisions, args.device)
    except ValueError as e:
        parser.error(str(e))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    from ibedl.training.config import load_config
    from ibedl.training.distributed import OptionScorer
    from ibedl.training.finetune import build
    from ibedl.training.methods import METHODS

    configs = {p: load_config(args.config, [f"device={args.device}", "progress=false", *PRECISIONS[p]])
               for p in precisions}
    args.batch_size = args.batch_size or configs["fp32"].optim.batch_size
    try:  # before the models: a request the data cannot meet is refused at once
        batches = training_batches(args.batch_size, args.steps)
    except ValueError as e:
        parser.error(f"--batch-size {args.batch_size} --steps {args.steps}: {e}")
    method = METHODS[configs["fp32"].method]
    runs = {}
    for p in precisions:
        torch.manual_seed(0)
        predictor, _, _, params, _ = build(configs[p], method)
        runs[p] = (OptionScorer(predictor).train(), predictor, params, autocast_of(p, args.device))
    encode = runs["fp32"][1].encode
    warm = encode(batches[0]).to(args.device)
    y0 = torch.tensor([q.answer for q in batches[0]], device=args.device)
    for scorer, _, params, autocast in runs.values():  # first-call costs fall on an untimed pass of each
        one_pass(scorer, method, params, warm, y0, 0, autocast)
    seconds, peaks, worst = ({p: [] for p in precisions}, {p: [] for p in precisions}, dict.fromkeys(precisions, 0.0))
    tokens, padded = [], []
    for i, batch in enumerate(batches):
        enc = encode(batch).to(args.device)
        tokens.append(int(enc.attention_mask.sum()))
        padded.append(enc.input_ids.numel())
        y = torch.tensor([q.answer for q in batch], device=args.device)
        order = precisions[i % len(precisions):] + precisions[:i % len(precisions)]
        grads = {}
        for p in order:
            scorer, _, params, autocast = runs[p]
            before = torch.cuda.memory_allocated() if args.device == "cuda" else 0  # every precision's model stays
            s, grads[p] = one_pass(scorer, method, params, enc, y, seed=i, autocast=autocast)
            seconds[p].append(s)
            if args.device == "cuda":
                peaks[p].append(torch.cuda.max_memory_allocated() - before)
        scale = max(float(g.abs().max()) for g in grads["fp32"])
        for p in precisions:
            worst[p] = max(worst[p], max(float((a.float() - b).abs().max())
                                         for a, b in zip(grads[p], grads["fp32"], strict=True)) / scale)
        print(f"batch {i + 1}/{len(batches)}: " + ", ".join(f"{p} {seconds[p][-1]:.2f} s" for p in precisions),
              flush=True)
    profiles = {}
    for p, (scorer, _, params, autocast) in runs.items():
        def step(scorer=scorer, params=params, autocast=autocast):
            loss_of(scorer, method, params, warm, y0, 0, autocast).backward()
            scorer.zero_grad(set_to_none=True)
        profiles[p] = operator_table(step, args.device, top=8, counts=True)
    reference = profiles["fp32"].pop("calls_by_operator")
    for p in precisions[1:]:  # the operators whose calls differ most from fp32's: [fp32's, this one's]
        calls = profiles[p].pop("calls_by_operator")
        names = sorted(set(calls) | set(reference), key=lambda n: -abs(calls.get(n, 0) - reference.get(n, 0)))
        profiles[p]["calls_unlike_fp32"] = {n: [reference.get(n, 0), calls.get(n, 0)] for n in names[:8]
                                            if calls.get(n, 0) != reference.get(n, 0)}
    result = {
        "command": " ".join(["python", "-m", "benchmarks.training_precision",
                             *(argv if argv is not None else sys.argv[1:])]),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else cpu_features(),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "config": args.config,
        "method": configs["fp32"].method, "batch_size": args.batch_size, "batches": len(batches),
        "mean_prompt_tokens": sum(tokens) / sum(map(len, batches)),
        "mean_padded_tokens": sum(padded) / sum(map(len, batches)),
        "precisions": {p: {"overrides": PRECISIONS[p], "mean_step_s": sum(seconds[p]) / len(seconds[p]),
                           "vs_fp32_time": paired_ratio(seconds[p], seconds["fp32"]) if p != "fp32" else None,
                           "gradient_max_rel_diff_vs_fp32": worst[p],
                           "pass_peak_above_start_mib": max(peaks[p]) / 2**20 if peaks[p] else None,
                           "one_pass_operators": profiles[p]} for p in precisions},
    }
    write_result(args.output or device_output("training_precision", args.device), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
