"""What folding the adapter into the base's weights saves a forward pass, on this machine's CPU or a CUDA GPU: the
``torch-cuda-merged-*`` backends against the unmerged trunk in the same precision.

    python -m benchmarks.merged_adapter [--artifact artifacts/default] [--device cpu] [--dtypes float32]
        [--batch-sizes 1,8] [--rounds 10] [--output benchmarks/results/merged_adapter_<cpu|cuda>.json]

For each precision the artifact's adapter is loaded twice on ``--device``, as PEFT serves it and merged
(ibedl.core.backends.torch_cuda.load_trunk), and both answer the same batches of distinct SciQ training questions with
their passages (read whole up to the service's default limit of 1,024 tokens), alternating which runs first (drift
of the machine falls on both). Recorded per batch size: the
operators one forward dispatches (torch's profiler: ATen calls, and on CUDA kernel launches), each way's
milliseconds per forward, and the ratio of merged to unmerged time with a 95% paired bootstrap interval over the
batches (below 1: merging is faster here); per precision, how the answers of 64 questions differ (largest
probability difference, argmax agreement) and the CPU's features or the GPU's name. Default precisions: float32 on a
CPU (what its torch backend serves), bfloat16 and float32 on CUDA.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks.common import cpu_features, device_output, operator_table, paired_ratio, parse_sizes, write_result

WAYS = ("unmerged", "merged")
AGREEMENT_QUESTIONS = 64


def load_pair(artifact: str, device: str, dtype: str) -> dict:
    """The artifact's trunk on ``device`` in ``dtype``, unmerged (the predictor's own PEFT model) and merged
    (``Predictor.trunk`` callables), with the predictor for encoding and answering."""
    import torch

    from ibedl.core.backends.torch_cuda import TorchTrunk, load_trunk
    from ibedl.core.predictor import Predictor
    from ibedl.engine.settings import EngineSettings

    predictor = Predictor.from_artifact(artifact, device=device, dtype=getattr(torch, dtype), backend="torch")
    sha = predictor.manifest.base_model_ref().sha256
    adapter = Path(artifact) / predictor.manifest.members[0]
    trunks = {"unmerged": TorchTrunk(predictor.model),
              "merged": load_trunk(predictor.model.name_or_path, sha, adapter, device, dtype, False, merged=True)}
    predictor.max_tokens = EngineSettings.model_fields["max_tokens"].default  # prompts as the service reads them
    return {"predictor": predictor, "trunks": trunks}


def answers(pair: dict, way: str, questions: list) -> tuple[list, object]:
    """The predictor's answers to ``questions`` served on the trunk of ``way``, and their last-token states, (N, d)
    float32 flattened: one trunk pass per batch, the answers reading the states it kept (``reusing_hidden``)."""
    import torch

    from ibedl.core.backends import Built

    predictor = pair["predictor"]
    predictor.serve_on(Built(pair["trunks"][way], f"{way} trunk"))
    with predictor.reusing_hidden(), torch.no_grad():
        states = torch.cat([predictor.hidden(batch).float().flatten() for _, batch in predictor.batches(questions)])
        return predictor.predict(questions), states


def measure(pair: dict, batches: list[list], device: str) -> dict:
    """Both ways on each batch, alternating which runs first, after a warm-up of each; their operator counts."""
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    predictor, trunks = pair["predictor"], pair["trunks"]
    encoded = [predictor.encode(b) for b in batches]
    for way in WAYS:  # warm-up: first-call costs, not timed
        trunks[way](encoded[0])
    seconds = {w: [] for w in WAYS}
    for i, batch in enumerate(encoded[1:]):
        for way in WAYS if i % 2 == 0 else WAYS[::-1]:
            sync()
            start = time.perf_counter()
            trunks[way](batch)
            sync()
            seconds[way].append(time.perf_counter() - start)
    operators = {}
    for way in WAYS:
        table = operator_table(lambda w=way: trunks[w](encoded[0]), device)
        operators[way] = {k: table[k] for k in ("operator_calls", "kernel_launches", "operator_cpu_s", "kernel_s")}
    tokens = [int(b.attention_mask.sum()) for b in encoded[1:]]
    return {"batches": len(encoded) - 1, "questions_per_batch": len(batches[0]),
            "mean_real_tokens_per_batch": sum(tokens) / len(tokens),
            **{way: {"ms_per_forward": 1000 * sum(seconds[way]) / len(seconds[way]), **operators[way]}
               for way in WAYS},
            "operator_calls_merged_over_unmerged": operators["merged"]["operator_calls"]
            / operators["unmerged"]["operator_calls"],
            "merged_over_unmerged_time": paired_ratio(seconds["merged"], seconds["unmerged"])}


def agreement(pair: dict, questions: list) -> dict:
    """How the two ways' answers to ``questions`` differ, and their last-token states (the largest difference over
    the largest state)."""
    (a, unmerged), (b, merged) = (answers(pair, way, questions) for way in WAYS)
    return {"questions": len(questions),
            "largest_state_difference": float((merged - unmerged).abs().max() / unmerged.abs().max()),
            "largest_probability_difference": max(abs(x - y) for p, q in zip(a, b, strict=True)
                                                  for x, y in zip(p.probs, q.probs, strict=True)),
            "same_answer": sum(p.index == q.index for p, q in zip(a, b, strict=True)) / len(questions)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.merged_adapter", description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="artifacts/default")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    parser.add_argument("--dtypes", default=None,
                        help="comma-separated torch dtypes (default: float32 on a CPU, bfloat16,float32 on CUDA)")
    parser.add_argument("--batch-sizes", default="1,8", help="questions per forward (default 1,8)")
    parser.add_argument("--rounds", type=int, default=10, help="timed batches per batch size (default 10)")
    parser.add_argument("--output", default=None,
                        help="default: benchmarks/results/merged_adapter_<cpu|cuda>.json, by --device")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error(f"--rounds must be >= 2, got {args.rounds}")
    try:
        sizes = parse_sizes(args.batch_sizes, "--batch-sizes")
    except ValueError as e:
        parser.error(str(e))
    import torch

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print(f"error: --device {args.device}: no CUDA device (torch {torch.__version__})", file=sys.stderr)
        return 2
    dtypes = [d.strip() for d in (args.dtypes or ("bfloat16,float32" if cuda else "float32")).split(",") if d.strip()]
    bad = [d for d in dtypes if d not in ("float32", "bfloat16", "float16")]
    if bad:
        parser.error(f"--dtypes: expected float32, bfloat16 or float16, got {bad}")
    from ibedl.training.data import load_dataset

    questions = load_dataset("sciq", "train", limit=max(sizes) * (args.rounds + 1) + AGREEMENT_QUESTIONS, seed=0)
    result = {"command": " ".join(["python", "-m", "benchmarks.merged_adapter",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "device": torch.cuda.get_device_name(args.device) if cuda else cpu_features(),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "artifact": args.artifact,
              "precisions": {}}
    output = args.output or device_output("merged_adapter", args.device)
    for dtype in dtypes:
        try:
            pair = load_pair(args.artifact, args.device, dtype)
        except (OSError, ValueError) as e:
            parser.error(f"--artifact {args.artifact}: {e}")
        row = {"agreement": agreement(pair, questions[-AGREEMENT_QUESTIONS:]), "batch_sizes": {}}
        for size in sizes:
            batches = [questions[i * size:(i + 1) * size] for i in range(args.rounds + 1)]
            row["batch_sizes"][str(size)] = measure(pair, batches, args.device)
        result["precisions"][dtype] = row
        write_result(output, result, echo=False)  # each precision as soon as it is measured
        del pair
    write_result(output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
