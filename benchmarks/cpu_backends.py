"""Inference backends on the CPU, measured against torch fp32 in one process, interleaved question by question.

    python -m benchmarks.cpu_backends [--artifact artifacts/default] [--questions 200] \
        [--backends torch openvino openvino-fp32 openvino-bf16] [--output benchmarks/results/cpu_backends.json]

On SciQ test questions with passages (the first ``--questions`` of a seed-0 draw): p50/p99 latency at batch 1,
throughput at batch 8, resident memory, answer agreement with torch, max |p - p_torch| and |u - u_torch|,
accuracy/ECE/NLL, and ratios against torch; llama.cpp (llama-cpp-python, same GGUF) prompt processing on the
same prompts as an outside reference when it is installed. The backends share one process and the same CPU
cores (which other jobs may share too): compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import write_result
from ibedl.core.backends import build_trunk
from ibedl.core.base_model import KNOWN_MODELS, known_gguf, resolve_model
from ibedl.core.prompt import format_prompt
from ibedl.core.predictor import Predictor
from ibedl.training import metrics
from ibedl.training.data import load_dataset


def rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def gflop_per_token(config, seq: float) -> float:
    """Matmul FLOP of one token through the trunk (2 per multiply-add), attention over seq/2 keys on average."""
    d, ff, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = d * config.num_key_value_heads // config.num_attention_heads
    linear = 2 * d * d + 2 * d * kv + 3 * d * ff
    return (2 * linear + 4 * (seq / 2) * d) * layers / 1e9


def peak_gflops(seconds: float = 2.0) -> dict:
    """fp32 peak of the cores this process may use, two ways: nominal (2 FMA pipes x 8 lanes at the clock
    /proc/cpuinfo reports; AVX-512 on Zen 4 runs as 2 x 256 bit, and the cores boost above that clock) and
    measured (a 2048 x 2048 fp32 matrix product through torch, the best of repeated runs over ``seconds``).
    Fractions of the peak are given against the measured one, which the nominal figure can undershoot."""
    mhz = max(float(line.split(":")[1]) for line in open("/proc/cpuinfo") if line.startswith("cpu MHz"))
    cores = len(os.sched_getaffinity(0))
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return {"cores": cores, "mhz": mhz, "flop_per_cycle_fp32": 32, "nominal_gflops": cores * mhz / 1e3 * 32,
            "gflops": 2 * 2048**3 / best / 1e9, "gflops_is": "measured: best fp32 2048x2048 torch.mm"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="artifacts/default")
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--backends", nargs="+", default=["torch", "openvino", "openvino-fp32", "openvino-bf16"])
    parser.add_argument("--output", default="benchmarks/results/cpu_backends.json")
    args = parser.parse_args(argv)
    questions = load_dataset("sciq", "test", limit=args.questions, seed=0)
    artifact = Path(args.artifact)
    predictor = Predictor.from_artifact(artifact)
    sha = resolve_model(predictor.manifest.base_model_ref().ref).sha256
    trunks, memory = {}, {"torch_model_rss_mib": rss_mib()}
    for name in args.backends:
        before = rss_mib()
        start = time.perf_counter()
        trunks[name] = build_trunk(name, predictor, artifact, sha)
        memory[f"{name}_added_rss_mib"] = rss_mib() - before
        memory[f"{name}_load_s"] = time.perf_counter() - start

    def use(name):
        predictor.trunk = trunks[name]

    tokens = [len(predictor._encode_one(i, q, True)) for i, q in enumerate(questions)]
    seq = float(np.mean(tokens))
    gflop = gflop_per_token(predictor.model.config, seq) * seq
    result = {
        "note": "one process, backends interleaved question by question: compare the ratios (absolute times depend on "
                "what else runs on the cores)",
        "questions": len(questions), "split": "sciq test, seed 0, with passages", "mean_prompt_tokens": seq,
        "gflop_per_question": gflop, "peak": peak_gflops(), "torch_threads": torch.get_num_threads(),
        "memory": memory, "backends": {},
    }
    for name in args.backends:  # warm-up
        use(name)
        predictor.predict(questions[:2])
    latency = {n: [] for n in args.backends}
    answers = {n: [] for n in args.backends}
    for q in questions:
        for name in args.backends:
            use(name)
            start = time.perf_counter()
            answers[name].append(predictor.predict([q])[0])
            latency[name].append(time.perf_counter() - start)
    rate = {n: 0.0 for n in args.backends}
    for i in range(0, len(questions), 8):
        for name in args.backends:
            use(name)
            start = time.perf_counter()
            predictor.predict(questions[i : i + 8])
            rate[name] += time.perf_counter() - start
    labels = [q.answer for q in questions]
    ref = answers[args.backends[0]]
    for name in args.backends:
        preds = answers[name]
        summary = metrics.summarise([p.probs for p in preds], labels, [p.uncertainty for p in preds])
        p50 = float(np.percentile(latency[name], 50))
        result["backends"][name] = {
            "latency_p50_s": p50,
            "latency_p99_s": float(np.percentile(latency[name], 99)),
            "batch8_questions_per_s": len(questions) / rate[name],
            "gflops_at_p50": gflop / p50,
            "fraction_of_fp32_peak_at_p50": gflop / p50 / result["peak"]["gflops"],
            "agreement_with_torch": float(np.mean([a.index == b.index for a, b in zip(preds, ref)])),
            "max_abs_prob_diff": max(max(abs(x - y) for x, y in zip(a.probs, b.probs)) for a, b in zip(preds, ref)),
            "max_abs_u_diff": max(abs(a.uncertainty - b.uncertainty) for a, b in zip(preds, ref)),
            **{k: summary[k] for k in ("accuracy", "ece", "nll")},
        }
    base = result["backends"][args.backends[0]]
    for name, r in result["backends"].items():
        r["p50_speedup_vs_torch"] = base["latency_p50_s"] / r["latency_p50_s"]
        r["throughput_vs_torch"] = r["batch8_questions_per_s"] / base["batch8_questions_per_s"]
    result["peak_rss_mib_process"] = rss_mib("VmHWM")
    result["llama_cpp"] = llama_cpp_reference(predictor, questions, latency[args.backends[0]])
    write_result(args.output, result)
    return 0


def llama_cpp_reference(predictor, questions, torch_latency) -> dict:
    """Prompt processing of the same prompts by llama.cpp on the same GGUF, one prompt at a time, as the outside
    reference, through llama-cpp-python (the ``bench`` extra) when installed. The GGUF holds the Q4_1 weights our
    base model is dequantised from, so llama.cpp computes with the same weights in its own kernels, without our
    adapter or head."""
    gguf = known_gguf(KNOWN_MODELS["smollm2-135m-instruct"])
    prompts = [format_prompt(q, predictor.template, predictor.tokenizer) for q in questions]
    threads = torch.get_num_threads()
    try:
        from llama_cpp import Llama, __version__
    except ImportError:
        return {"skipped": "llama-cpp-python is not installed (pip install -e '.[bench]' compiles it)"}
    llm = Llama(model_path=str(gguf), n_ctx=1024, n_batch=1024, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    tokenize = lambda text: llm.tokenize(text.encode(), add_bos=False, special=True)  # noqa: E731
    reset, evaluate, binding = llm.reset, llm.eval, f"llama-cpp-python {__version__}"
    ids = [tokenize(p) for p in prompts]
    reset()
    evaluate(ids[0])  # warm-up
    times = []
    for seq in ids:
        reset()
        start = time.perf_counter()
        evaluate(seq)
        times.append(time.perf_counter() - start)
    p50 = float(np.percentile(times, 50))
    return {"binding": binding, "gguf": gguf.name, "threads": threads,
            "mean_prompt_tokens": float(np.mean([len(s) for s in ids])),
            "prompt_latency_p50_s": p50, "prompt_latency_p99_s": float(np.percentile(times, 99)),
            "prompt_tokens_per_s": float(sum(len(s) for s in ids) / sum(times)),
            "p50_speedup_vs_torch": float(np.percentile(torch_latency, 50)) / p50,
            "note": "batch 1, measured after the backends, not interleaved; Q4_1 weights in llama.cpp's kernels; "
                    "the full LM head runs for the last token"}


if __name__ == "__main__":
    sys.exit(main())
