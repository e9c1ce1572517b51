"""Option rows vs full-vocabulary logits, and IB-EDL inference overhead vs MAP, on the real model.

    python -m benchmarks.option_rows [--base-model smollm2-135m-instruct] [--rounds 6] [--batch-size 4]
        [--output benchmarks/results/option_rows.json]

Training step (LoRA forward + backward + optimizer) of the same batches two ways:
  rows: hidden state of the last real token x the C option rows of the head   (this project)
  full: the LM's logits for every position and the whole vocabulary, then the option columns
        of the last position                                                    (the reference code)
Timings alternate the two paths in one process. Peak memory: on CUDA, torch's peak allocation per
path in this process; on CPU, a child process per path samples its resident set during the steps and
reports the peak above the resident set before them.
Inference: forward samples/s with the MAP (softmax) head, and with the IB-EDL head in its mean
and quadrature modes and as Algorithm 1's K-sample average, as ratios to MAP.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.common import REPO, cpu_features, write_result
from ibedl.core.base_model import load_base_model, resolve_model
from ibedl.core.head import HeadConfig, build_head
from ibedl.core.predictor import Predictor, lm_head_rows
from ibedl.core.prompt import option_token_ids
from ibedl.training.data import load_dataset
from ibedl.training.losses import cross_entropy, ib_edl_risk, sample_pre_evidence

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def setup(args):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    resolved = resolve_model(args.base_model)
    model, tok = load_base_model(resolved, device=args.device)
    ids = option_token_ids(tok, 26)
    rows = lm_head_rows(model, ids)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=TARGETS))
    heads = {kind: build_head(HeadConfig(kind, 26, rows.shape[1]), rows).to(model.device)
             for kind in ("softmax", "ib_edl")}
    predictor = Predictor(model, tok, heads["softmax"], template=args.template, max_tokens=384)
    questions = load_dataset("sciq", "train", limit=args.batch_size * args.rounds, seed=1)
    batches = [questions[i : i + args.batch_size] for i in range(0, len(questions), args.batch_size)]
    return predictor, heads, ids, batches


def train_step(predictor, head, ids, batch, path: str, optimizer) -> float:
    enc = predictor.encode(batch).to(predictor.device)
    mask = enc.option_mask
    y = torch.tensor([q.answer for q in batch], device=predictor.device)
    start = time.perf_counter()
    if path == "rows":
        logits = head(predictor.hidden(enc), mask).logits
    else:
        full = predictor.model(input_ids=enc.input_ids, attention_mask=enc.attention_mask,
                               use_cache=False).logits  # (B, S, V)
        last = full[torch.arange(full.shape[0], device=full.device), enc.last_index]  # (B, V)
        logits = last[:, ids[: mask.shape[1]]].float()
    loss = cross_entropy(logits, y, mask).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if predictor.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def current_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def memory_child(args) -> int:
    """Run a few steps of one path and print the peak RSS above the RSS before them (CPU).

    ru_maxrss cannot be used: loading the model peaks higher than a training step. A thread samples
    the resident set every 2 ms instead.
    """
    import gc
    import threading

    predictor, heads, ids, batches = setup(args)
    params = [p for p in predictor.model.parameters() if p.requires_grad] + list(heads["softmax"].parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    train_step(predictor, heads["softmax"], ids, batches[0], args.memory_child, optimizer)  # optimizer state
    gc.collect()
    base = current_rss_mib()
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], current_rss_mib())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for batch in batches[:3]:
        train_step(predictor, heads["softmax"], ids, batch, args.memory_child, optimizer)
    stop.set()
    sampler.join()
    print(json.dumps({"peak_rss_mib": peak[0], "before_steps_rss_mib": base, "growth_mib": peak[0] - base}))
    return 0


def time_training(args, predictor, heads, ids, batches) -> tuple[dict, dict]:
    """(training samples per second, peak memory in MiB) of the option-rows path and the full-vocabulary one,
    interleaved over ``batches``; the memory from CUDA's allocator, or on CPU from a child process per path."""
    device = predictor.device
    params = [p for p in predictor.model.parameters() if p.requires_grad] + list(heads["softmax"].parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-5)  # small lr: the weights barely move between paths
    times = {"rows": [], "full": []}
    memory = {}
    train_step(predictor, heads["softmax"], ids, batches[0], "rows", optimizer)  # warm-up
    train_step(predictor, heads["softmax"], ids, batches[0], "full", optimizer)
    for batch in batches:
        for path in ("rows", "full"):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times[path].append(train_step(predictor, heads["softmax"], ids, batch, path, optimizer))
            if device.type == "cuda":
                memory[path] = max(memory.get(path, 0.0), torch.cuda.max_memory_allocated() / 2**20)
    if device.type != "cuda":
        for path in ("rows", "full"):
            # as a module with the repository on its path, like every benchmark (run as a file, it cannot import
            # benchmarks.common), in the caller's directory (relative paths keep their meaning)
            path_env = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
            out = subprocess.run([sys.executable, "-m", "benchmarks.option_rows", "--memory-child", path,
                                  "--base-model", args.base_model, "--batch-size", str(args.batch_size), "--rounds",
                                  "3", "--template", args.template],
                                 capture_output=True, text=True, check=True,
                                 env={**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": path_env})
            memory[path] = json.loads(out.stdout.strip().splitlines()[-1])["growth_mib"]
    return {p: args.batch_size / statistics.median(t) for p, t in times.items()}, memory


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default=None)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--template", default="chat-v1")
    parser.add_argument("--output", default="benchmarks/results/option_rows.json")
    parser.add_argument("--memory-child", choices=["rows", "full"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        return memory_child(args)

    predictor, heads, ids, batches = setup(args)
    device = predictor.device
    rate, memory = time_training(args, predictor, heads, ids, batches)

    # Inference: one trunk forward per batch, then each head on the same hidden states.
    predictor.model.eval()
    infer = {"map": [], "ib_edl_mean": [], "ib_edl_quadrature": [], "ib_edl_k20_samples": []}
    quad = build_head(HeadConfig("ib_edl", 26, heads["ib_edl"].config.hidden_size, inference="quadrature"))
    quad.load_state_dict(heads["ib_edl"].state_dict())
    quad.to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for batch in batches:
            enc = predictor.encode(batch).to(device)
            mask = enc.option_mask
            for name in infer:
                start = time.perf_counter()
                h = predictor.hidden(enc)
                if name == "map":
                    heads["softmax"](h, mask)
                elif name == "ib_edl_mean":
                    heads["ib_edl"](h, mask)
                elif name == "ib_edl_quadrature":
                    quad(h, mask)
                else:  # Algorithm 1 at inference: average K sampled pre-evidences, then alpha
                    mu, sigma = heads["ib_edl"].gaussian(h, mask)
                    e = sample_pre_evidence(mu, sigma, 20, gen).mean(0)
                    F.softplus(e) + 1
                if device.type == "cuda":
                    torch.cuda.synchronize()
                infer[name].append(time.perf_counter() - start)
    infer_rate = {k: args.batch_size / statistics.median(v) for k, v in infer.items()}
    # Head-only cost, isolated from the trunk: the overhead that IB-EDL adds per question.
    h = torch.randn(args.batch_size, heads["ib_edl"].config.hidden_size, device=device)
    mask = torch.ones(args.batch_size, 4, dtype=torch.bool, device=device)
    head_us = {}
    for name, fn in (("map", lambda: heads["softmax"](h, mask)), ("ib_edl_mean", lambda: heads["ib_edl"](h, mask)),
                     ("ib_edl_quadrature", lambda: quad(h, mask)),
                     ("ib_edl_training_loss_k20",
                      lambda: ib_edl_risk(*heads["ib_edl"].gaussian(h, mask),
                                          torch.zeros(args.batch_size, dtype=torch.long, device=device), mask, 20))):
        with torch.no_grad():
            for _ in range(20):
                fn()
            start = time.perf_counter()
            for _ in range(200):
                fn()
        head_us[name] = (time.perf_counter() - start) / 200 * 1e6
    result = {
        "model": args.base_model,
        "device": str(device),
        "cpu": cpu_features(),
        "threads": torch.get_num_threads(),
        "batch_size": args.batch_size,
        "rounds": len(batches),
        "mean_tokens": statistics.mean(predictor.encode(b).attention_mask.sum(1).float().mean().item()
                                       for b in batches),
        "train_samples_per_s": rate,
        "train_speedup_rows_vs_full": rate["rows"] / rate["full"],
        "train_peak_memory_mib": memory,
        "train_memory_full_vs_rows": memory["full"] / memory["rows"] if memory.get("rows") else None,
        "inference_samples_per_s": infer_rate,
        "inference_ratio_vs_map": {k: v / infer_rate["map"] for k, v in infer_rate.items()},
        "head_microseconds_per_batch": head_us,
    }
    write_result(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
