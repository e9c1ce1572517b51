"""What padding costs a forward pass, on this machine's CPU or a CUDA GPU: the choice ``IBEDL_PAD_FREELY`` makes.

    python -m benchmarks.padding_cost [--artifact artifacts/default] [--device cpu] [--backend torch]
        [--batch-size 16] [--batches 24] [--output benchmarks/results/padding_cost_<cpu|cuda>.json]

The predictor answers the same batches of distinct SciQ training questions, with their passages, two ways: in
groups of similar length padded to at most 1.25x their real tokens (``Predictor.max_padding``, the service's
default) and as one forward padded to the batch's longest prompt (``IBEDL_PAD_FREELY=true``). The two alternate
batch by batch (grouped first, then free first, ...), so drift of the machine falls on both. Recorded: each way's
questions/s, forwards and padded tokens, the ratio of free to grouped time with a 95% paired bootstrap interval over
the batches (above 1: padding freely is slower here), the largest difference between the two ways' probabilities,
and the CPU's features or the GPU's name. What this leaves out: the batcher's own rule (a pass takes questions within
a factor 2 of its first one's length), which decides what a pass holds before the predictor groups it.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from benchmarks.common import cpu_features, device_output, paired_ratio, write_result

WAYS = ("grouped", "free")
MAX_PADDING = {"grouped": 1.25, "free": math.inf}


def padded_tokens(lengths: list[int], max_padding: float) -> tuple[int, int]:
    """(forwards, padded tokens) of ``Predictor.predict`` on prompts of ``lengths`` at ``max_padding``."""
    from ibedl.core.predictor import length_groups

    groups = length_groups(lengths, max_padding)
    return len(groups), sum(len(g) * max(lengths[i] for i in g) for g in groups)


def measure(predictor, batches: list[list]) -> dict:
    """Both ways on each batch of questions, alternating which runs first; ``predictor`` warmed up by the caller."""
    import torch

    sync = torch.cuda.synchronize if predictor.device.type == "cuda" else (lambda: None)
    seconds = {w: [] for w in WAYS}
    forwards, padded, real = dict.fromkeys(WAYS, 0), dict.fromkeys(WAYS, 0), 0
    largest_difference = 0.0
    for i, questions in enumerate(batches):
        lengths = predictor.encode(questions).attention_mask.sum(1).tolist()  # as predict cuts them
        real += sum(lengths)
        probabilities = {}
        for way in WAYS if i % 2 == 0 else WAYS[::-1]:
            predictor.max_padding = MAX_PADDING[way]
            n, tokens = padded_tokens(lengths, MAX_PADDING[way])
            forwards[way] += n
            padded[way] += tokens
            sync()
            start = time.perf_counter()
            answers = predictor.predict(questions)
            sync()
            seconds[way].append(time.perf_counter() - start)
            probabilities[way] = [p.probs for p in answers]
        largest_difference = max(largest_difference, max(
            abs(a - b) for g, f in zip(probabilities["grouped"], probabilities["free"], strict=True)
            for a, b in zip(g, f, strict=True)))
    questions = sum(len(b) for b in batches)
    return {"batches": len(batches), "questions": questions, "real_tokens": real,
            **{way: {"questions_per_s": questions / sum(seconds[way]), "seconds": sum(seconds[way]),
                     "forwards": forwards[way], "padded_tokens": padded[way]} for way in WAYS},
            "free_over_grouped_time": paired_ratio(seconds["free"], seconds["grouped"]),
            "largest_probability_difference": largest_difference}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.padding_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="artifacts/default")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    parser.add_argument("--backend", default="torch", help="the trunk's inference backend (default torch)")
    parser.add_argument("--batch-size", type=int, default=16, help="questions per batch (default 16, the service's)")
    parser.add_argument("--batches", type=int, default=24, help="batches, each answered both ways (default 24)")
    parser.add_argument("--output", default=None,
                        help="default: benchmarks/results/padding_cost_<cpu|cuda>.json, by --device")
    args = parser.parse_args(argv)
    for flag, least in (("batch_size", 1), ("batches", 2)):
        if getattr(args, flag) < least:
            parser.error(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(args, flag)}")
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: --device {args.device}: no CUDA device (torch {torch.__version__})", file=sys.stderr)
        return 2
    from ibedl.core.predictor import Predictor
    from ibedl.training.data import load_dataset

    try:
        predictor = Predictor.from_artifact(args.artifact, device=args.device, backend=args.backend)
    except (OSError, ValueError) as e:
        parser.error(f"--artifact {args.artifact}: {e}")
    questions = load_dataset("sciq", "train", limit=args.batch_size * (args.batches + 1), seed=0)
    batches = [questions[i: i + args.batch_size] for i in range(0, len(questions), args.batch_size)]
    predictor.predict(batches[0])  # warm-up (first-call costs), not timed
    predictor.max_padding = math.inf
    predictor.predict(batches[0])
    row = measure(predictor, batches[1:])
    device = (torch.cuda.get_device_name(predictor.device) if predictor.device.type == "cuda"
              else cpu_features())
    result = {"command": " ".join(["python", "-m", "benchmarks.padding_cost", *(argv if argv is not None
                                                                                 else sys.argv[1:])]),
              "device": device, "torch": torch.__version__, "backend": predictor.backend,
              "threads": torch.get_num_threads(), "artifact": args.artifact, "batch_size": args.batch_size, **row}
    write_result(args.output or device_output("padding_cost", args.device), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
