"""The GPU path end to end on a lent CUDA machine, in one command that fits its time (``make gpu-check``):

    python -m benchmarks.gpu_check [--steps 300] [--requests 256] [--only train,calibrate,serve,paper]
        [--output benchmarks/results/gpu_check.json]

1. ``train``: a few hundred IB-EDL steps in fp32, bf16 and bf16 on a 4-bit NF4 base (benchmarks.gpu_path: training
   samples/s and peak GPU memory of each, and test accuracy).
2. ``calibrate``: the committed default adapter calibrated on the arithmetic it will be served with (CUDA, bf16 on
   a 4-bit base: ``torch-cuda-nf4-bf16``), into a copy under ``runs/gpu_check``.
3. ``serve``: that copy served on CUDA (``IBEDL_DEVICE=cuda``, ``IBEDL_LOAD_IN_4BIT=true``): readiness, the
   calibration the service reports it uses, answers/s from 32 concurrent clients, and the GPU memory of the service
   process (nvidia-smi).
4. ``paper``: the 8B-shaped throughput run (benchmarks.paper_scale_gpu, random bf16 Llama3-8B shape) beside the
   paper's H100 figures: 68.08 test and 26.41 train samples/s, 21.88 GB peak.

Needs CUDA and bitsandbytes (``pip install -e '.[gpu]'`` with a CUDA build of torch); without them it exits 2 at
once, saying what is missing. CI never runs it. Each step's result is written as soon as it is known, so a run cut
short by the machine's time keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import write_result

STEPS = ("train", "calibrate", "serve", "paper")
RUNS = Path("runs/gpu_check")
PAPER_H100 = {"test_samples_per_s": 68.08, "train_samples_per_s": 26.41, "peak_memory_gb": 21.88}


def missing_gpu() -> str | None:
    """Why this machine cannot run the check, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed: make setup"
    if not torch.cuda.is_available():
        return (f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}): run this on a lent "
                "GPU machine with a CUDA build of torch; CI never runs it")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return "bitsandbytes is not installed (the 4-bit base): pip install -e '.[gpu]'"
    return None


def step_train(args, out: Path) -> dict:
    from benchmarks import gpu_path

    path = out.with_name(out.stem + "_train.json")
    code = gpu_path.main(["--steps", str(args.steps), "--output", str(path), "--runs-dir", str(RUNS / "train")])
    return {"exit": code, **(json.loads(path.read_text()) if path.is_file() else {})}


def step_calibrate(args, out: Path) -> dict:
    from ibedl.core.artifact import read_manifest
    from ibedl.training import calibrate

    target = RUNS / "default-cuda"
    if target.exists():
        shutil.rmtree(target)
    code = calibrate.main(["--artifact", args.artifact, "--output", str(target), "--dataset", "sciq", "--split",
                           "validation", "--ood-rejection-rate", "0.15", "--device", "cuda", "--dtype", "bfloat16",
                           "--load-in-4bit", "--no-progress"])
    if code != 0:
        return {"exit": code}
    manifest = read_manifest(target)
    key = "torch-cuda-nf4-bf16"
    served = manifest.calibration_for(key)
    return {"exit": code, "artifact": str(target), "calibrations": manifest.calibration_keys(),
            "calibration": None if served is None else {
                "min_confidence": served.thresholds.min_confidence, "ood_threshold": served.thresholds.ood_threshold,
                "answered_on_calibration_part": served.thresholds.how.get("coverage"), "head": served.head}}


def gpu_memory_mib(pid: int) -> float | None:
    """GPU memory nvidia-smi reports for process ``pid``, MiB."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    used = [float(mem) for p, mem in (line.split(",") for line in text.strip().splitlines() if "," in line)
            if int(p) == pid]
    return sum(used) if used else None


def step_serve(args, out: Path) -> dict:
    import httpx

    from benchmarks.service_process import ServiceProcess
    from ibedl.training.data import load_dataset

    artifact = RUNS / "default-cuda"
    if not (artifact / "manifest.json").is_file():
        return {"skipped": "no CUDA-calibrated copy: run the calibrate step first"}
    log = RUNS / "serve.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = ServiceProcess(artifact, {"IBEDL_DEVICE": "cuda", "IBEDL_LOAD_IN_4BIT": "true", "IBEDL_BACKEND": "auto",
                                     "IBEDL_MAX_BATCH_SIZE": "32"}, log)
    try:
        proc.wait_ready(timeout=300)
        card = httpx.get(proc.url + "/v1/models", timeout=30).json()["data"][0]
        questions = load_dataset("sciq", "test", limit=args.requests, seed=0)
        bodies = [{"question": q.question, "options": list(q.options), "context": q.context} for q in questions]
        with httpx.Client(timeout=120) as client:
            client.post(proc.url + "/predict", json=bodies[0])  # warm-up
            start = time.perf_counter()
            with ThreadPoolExecutor(32) as pool:
                codes = list(pool.map(lambda b: client.post(proc.url + "/predict", json=b).status_code, bodies))
            seconds = time.perf_counter() - start
        memory = gpu_memory_mib(proc.proc.pid)
    finally:
        stopped = proc.stop()
    return {"backend": card["backend"], "calibration_in_use": card["calibration_in_use"],
            "requests": len(bodies), "ok": sum(c == 200 for c in codes), "questions_per_s": len(bodies) / seconds,
            "gpu_memory_mib": memory, "exit_on_sigterm": stopped, "log": str(log)}


def step_paper(args, out: Path) -> dict:
    from benchmarks import paper_scale_gpu
    from ibedl.core.base_model import resolve_model
    from ibedl.training.data import load_dataset

    questions = RUNS / "paper_questions.json"
    questions.parent.mkdir(parents=True, exist_ok=True)
    questions.write_text(json.dumps([{"question": q.question, "options": list(q.options), "context": q.context,
                                      "answer": q.answer} for q in load_dataset("sciq", "train", limit=256, seed=0)]))
    path = out.with_name(out.stem + "_paper_scale.json")
    code = paper_scale_gpu.main(["--questions", str(questions), "--tokenizer", str(resolve_model(
        "smollm2-135m-instruct").path), "--output", str(path)])
    result = json.loads(path.read_text()) if path.is_file() else {}
    rows = result.get("paths", {}).get("rows", {})
    return {"exit": code, "paper_h100": PAPER_H100, "measured_rows": rows,
            "vs_paper": result.get("rows_vs_paper"), "device": result.get("device")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="artifacts/default")
    parser.add_argument("--steps", type=int, default=300, help="training steps per variant (default 300)")
    parser.add_argument("--requests", type=int, default=256, help="SciQ test questions sent to the CUDA service")
    parser.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps among {', '.join(STEPS)}")
    parser.add_argument("--output", default="benchmarks/results/gpu_check.json")
    args = parser.parse_args(argv)
    steps = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        parser.error(f"unknown steps {unknown}; choose among {', '.join(STEPS)}")
    if args.steps < 1 or args.requests < 1:
        parser.error(f"--steps and --requests must be >= 1, got {args.steps} and {args.requests}")
    why = missing_gpu()
    if why is not None:
        print(f"error: make gpu-check needs a GPU: {why}", file=sys.stderr)
        return 2
    import torch

    out = Path(args.output)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "steps": {}}
    run = {"train": step_train, "calibrate": step_calibrate, "serve": step_serve, "paper": step_paper}
    failed = False
    for name in steps:
        start = time.perf_counter()
        try:
            result["steps"][name] = run[name](args, out)
        except Exception as e:  # one step's failure is recorded; the next steps still run
            result["steps"][name] = {"error": f"{type(e).__name__}: {e}"}
        result["steps"][name]["seconds"] = round(time.perf_counter() - start, 1)
        failed |= "error" in result["steps"][name] or result["steps"][name].get("exit", 0) != 0
        write_result(out, result, echo=False)
        print(f"{name}: {json.dumps(result['steps'][name])[:400]}", flush=True)
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
