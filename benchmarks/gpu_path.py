"""The GPU path: the same IB-EDL fine-tuning in fp32, bf16 and bf16 + 4-bit NF4 (bitsandbytes), with
training samples/s and peak GPU memory as ratios against fp32, and 4-bit inference of the bf16 adapter.

    python -m benchmarks.gpu_path [--base-model REF] [--steps 150] [--batch-size 8]
        [--output benchmarks/results/gpu_path.json]

Needs CUDA (and bitsandbytes for the 4-bit rows); prints one JSON object, and writes it after each precision so a
run stopped early (benchmarks.gpu_check's budget) keeps those it finished.

Why micro-batches of 64 on a GPU (``--batch-size 64``, as gpu_check runs it): at the recipe's 8 a step of the 135M
model is bound by the CPU dispatching its kernels, not by the GPU (the H100 run of gpu_path.json: 30 samples/s in
fp32, about 270 ms a step). A step dispatches the same operations whatever its batch (counted on the CPU with
torch.profiler, a 4-layer Llama with LoRA on the 7 projections: 4,566 ATen operations a forward and backward, about
1,100 a layer, so some 30,000 for SmolLM2's 30), so samples/s grows with the batch until the GPU is busy. bf16 was
slower there for the same reason: PEFT keeps the LoRA weights in float32 (their AdamW updates would round away in
bf16), so each of the 210 LoRA layers casts its input up and its output down, and the base's RMSNorm casts up and
down: 16% more operations per step (5,317 against 4,566) and no time saved by bf16 matmuls that were never the
bottleneck. With large micro-batches the matmuls dominate and bf16 pays.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import write_result
from ibedl.core.predictor import Predictor
from ibedl.training.config import load_config
from ibedl.training.data import load_dataset
from ibedl.training.evaluate import evaluate
from ibedl.training.finetune import train

VARIANTS = {
    "fp32": ["dtype=float32"],
    "bf16": ["dtype=bfloat16"],
    "bf16-4bit": ["dtype=bfloat16", "load_in_4bit=true"],
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=8, help="training and evaluation batch (default 8, the "
                        "recipe's); the optimizer step sees this many questions")
    parser.add_argument("--output", default="benchmarks/results/gpu_path.json")
    parser.add_argument("--runs-dir", default="runs/gpu_path")
    parser.add_argument("--without-4bit", action="store_true",
                        help="leave out the NF4 rows (a machine without bitsandbytes)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        parser.error(f"--steps and --batch-size must be >= 1, got {args.steps} and {args.batch_size}")
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    test_q = load_dataset("sciq", "test", limit=500)
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "steps": args.steps,
               "batch_size": args.batch_size, "runs": {}}
    variants = {k: v for k, v in VARIANTS.items() if not (args.without_4bit and "load_in_4bit=true" in v)}
    for name, extra in variants.items():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        cfg = load_config("ibedl/training/configs/smollm2_science_ib_edl.yaml", [
            f"base_model={args.base_model}", f"output={args.runs_dir}/{name}", f"optim.max_steps={args.steps}",
            f"optim.batch_size={args.batch_size}", f"eval_batch_size={args.batch_size}", "data.test=[]",
            "progress=false", "device=cuda", *extra,
        ])
        start = time.time()
        artifact = train(cfg, command=f"python -m benchmarks.gpu_path {name}")
        manifest = json.loads((artifact / "manifest.json").read_text())
        run = manifest["training"]["run"]
        peak = torch.cuda.max_memory_allocated() / 2**20
        predictor = Predictor.from_artifact(artifact, base_model=args.base_model,
                                            dtype=cfg.dtype and getattr(torch, cfg.dtype),
                                            load_in_4bit=cfg.load_in_4bit)
        res = evaluate(predictor, test_q, batch_size=max(32, args.batch_size), progress=False)
        results["runs"][name] = {
            "train_samples_per_s": run["samples_per_s"],
            "peak_gpu_mib": peak,
            "seconds": time.time() - start,
            "final_loss": json.loads((artifact / "history.jsonl").read_text().splitlines()[-1])["loss"],
            "test": {k: res.metrics[k] for k in ("n", "accuracy", "ece", "nll", "brier")},
            "test_samples_per_s": res.metrics["samples_per_s"],
        }
        del predictor
        print(name, json.dumps(results["runs"][name]), flush=True)
        write_result(args.output, results, echo=False)
    base = results["runs"]["fp32"]
    for r in results["runs"].values():
        r["speed_vs_fp32"] = r["train_samples_per_s"] / base["train_samples_per_s"]
        r["memory_vs_fp32"] = r["peak_gpu_mib"] / base["peak_gpu_mib"]
    if args.without_4bit:
        results["bf16_adapter_on_4bit_base"] = "not measured: --without-4bit"
        write_result(args.output, results)
        return 0
    # The bf16-trained adapter served with a 4-bit base: same answers?
    bf16 = Predictor.from_artifact(Path(args.runs_dir) / "bf16", base_model=args.base_model, dtype=torch.bfloat16)
    q4 = Predictor.from_artifact(Path(args.runs_dir) / "bf16", base_model=args.base_model, dtype=torch.bfloat16,
                                 load_in_4bit=True, allow_base_mismatch=True)
    a = evaluate(bf16, test_q, max(32, args.batch_size), progress=False)
    b = evaluate(q4, test_q, max(32, args.batch_size), progress=False)
    results["bf16_adapter_on_4bit_base"] = {
        "agreement": sum(x.index == y.index for x, y in zip(a.predictions, b.predictions, strict=True)) / len(test_q),
        "accuracy_bf16": a.metrics["accuracy"],
        "accuracy_4bit": b.metrics["accuracy"],
    }
    write_result(args.output, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
