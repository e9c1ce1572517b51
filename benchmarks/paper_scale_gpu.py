"""The paper's scale on a GPU: our predictor and training step on an 8B-shaped Llama (random weights, bf16),
option rows against the full-vocabulary-logits path, beside the paper's H100 figures.

    python -m benchmarks.paper_scale_gpu [--tokenizer DIR] [--dataset obqa | --questions q.json] [--batch-size 4] \
        [--steps 12] [--gradient-checkpointing] [--output benchmarks/results/paper_scale_gpu.json]

The questions: the first 256 of a built-in dataset's training split drawn with seed 0 (``--dataset``, default
``obqa``), or ``q.json``, a list of {question, options, context, answer}. The paper measured on OBQA (short
questions, no passages) in batches of 4 (:data:`PAPER_WORKLOAD`); the defaults run that workload, and
``rows_vs_paper`` says whether a run's did (``same_workload``). Other questions and batches measure other workloads
(the first H200 runs: SciQ with passages, about 2.2x the prompt tokens, in batches of 8).
``DIR``: by default the SmolLM2 tokenizer (token ids < 49,152 fit the Llama-3 vocabulary of 128,256). Random weights are
enough: speed and memory do not depend on their values. Needs CUDA.
Training step: LoRA r=8 on q/v (the paper's recipe), AdamW; ``rows`` = the IB-EDL head on the last-token
hidden state (K=20 samples + beta * KL, as in training), ``full`` = the reference path: LM logits
(B, S, 128,256), the option columns at the last token, cross-entropy. Test: no-grad forward of each path.
The two paths' timed steps alternate (rows then full, then full then rows, ...) on the same batches, so drift of the
machine and the order they run in fall on both; ``rows_vs_full`` gives each phase's speed ratio with a 95% paired
bootstrap interval over those pairs (the first run ran each path's steps in one block, rows first).
``train_kept_activation_gb``: the activations autograd keeps for one training step's backward pass on the first batch
(``kept_batch_padded_tokens``; weights left out), a device-independent share of the peak: ``--device cpu --layers N``
measures it at the real widths on a CPU (slowly), a decoder layer's share by difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import cpu_features, operator_table, paired_ratio, saved_activation_bytes, write_result
from ibedl.core.head import HeadConfig, build_head
from ibedl.core.predictor import Predictor, lm_head_rows
from ibedl.core.prompt import MCQuestion, option_token_ids
from ibedl.training.finetune import enable_gradient_checkpointing
from ibedl.training.losses import cross_entropy, gaussian_information, ib_edl_risk

PAPER_H100 = {"ib_edl_train_samples_per_s": 26.41, "ib_edl_test_samples_per_s": 68.08, "ib_edl_peak_memory_gb": 21.88,
              "source": "IB-EDL (ICLR 2025), Llama3-8B, one H100"}
# What those figures were measured on: the paper's appendix (Llama3-8B in mixed precision, OBQA for training and test)
# and the authors' configs (configs/_base_/edl_schedule.yaml: per-device train and eval batch 4, bf16).
PAPER_WORKLOAD = {"dataset": "obqa", "split": "train", "batch_size": 4, "precision": "bf16"}
QUESTIONS = 256  # --dataset's questions: the run cycles through their batches
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)


DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


PATHS = ("rows", "full")


def reset_peak():
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()  # the peak of allocated memory: the allocator's cache does not count


def peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 1e9 if DEVICE == "cuda" else 0.0


def build(args):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    if args.tokenizer is None:
        from ibedl.core.base_model import resolve_model

        args.tokenizer = str(resolve_model("smollm2-135m-instruct").path)
    qs = questions(args)  # before the model: a set too small for one batch is refused at once
    if len(qs) < args.batch_size:
        raise SystemExit(f"error: {len(qs)} questions do not fill one batch of {args.batch_size}")
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    with torch.device(DEVICE):
        shape = ({**LLAMA3_8B, "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512} if args.smoke
                 else {**LLAMA3_8B, "num_hidden_layers": args.layers or LLAMA3_8B["num_hidden_layers"]})
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.bfloat16)
    model.config.use_cache = False
    ids = option_token_ids(tok, 26)
    rows = lm_head_rows(model, ids)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    if args.gradient_checkpointing:  # what training's gradient_checkpointing: true does (the paper's runs did not)
        enable_gradient_checkpointing(model)
    head = build_head(HeadConfig("ib_edl", 26, rows.shape[1]), rows).to(DEVICE)
    predictor = Predictor(model, tok, head, template="chat-v1" if tok.chat_template else "plain-v1", max_tokens=512)
    batches = [qs[i : i + args.batch_size] for i in range(0, len(qs) - args.batch_size + 1, args.batch_size)]
    return predictor, head, ids, batches


def questions(args) -> list[MCQuestion]:
    """The questions the run steps through: ``--questions``' file, else ``--dataset``'s training questions."""
    if args.questions:
        data = json.loads(Path(args.questions).read_text())
        return [MCQuestion(d["question"], tuple(d["options"]), context=d.get("context"), answer=d["answer"])
                for d in data]
    from ibedl.training.data import load_dataset

    return load_dataset(args.dataset, "train", limit=QUESTIONS, seed=0)


def same_workload(args, device: str) -> bool:
    """Whether a run measured what the paper's figures were measured on: its questions and batch, on the whole model
    on a GPU, keeping the activations as the paper's runs did (its prompt format and tokenizer are not ours:
    ``mean_prompt_tokens`` says what ours gave)."""
    return (device == "cuda" and not args.questions and args.dataset == PAPER_WORKLOAD["dataset"]
            and args.batch_size == PAPER_WORKLOAD["batch_size"]
            and args.layers in (None, LLAMA3_8B["num_hidden_layers"]) and not args.gradient_checkpointing)


def step(predictor, head, ids, batch, path, optimizer, train: bool) -> float:
    enc = predictor.encode(batch).to(DEVICE)
    mask = enc.option_mask
    y = torch.tensor([q.answer for q in batch], device=DEVICE)
    sync()
    start = time.perf_counter()
    with torch.set_grad_enabled(train):
        if path == "rows":
            mu, sigma = head.gaussian(predictor.hidden(enc), mask)
            loss = (ib_edl_risk(mu, sigma, y, mask, 20, risk="nll")
                    + 1e-5 * gaussian_information(mu, sigma, mask)).mean()
        else:
            full = predictor.model(input_ids=enc.input_ids, attention_mask=enc.attention_mask, use_cache=False).logits
            last = full[torch.arange(full.shape[0], device=DEVICE), enc.last_index]  # (B, V)
            loss = cross_entropy(last[:, ids[: mask.shape[1]]].float(), y, mask).mean()
        if train:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--dataset", default=PAPER_WORKLOAD["dataset"],
                        help=f"a built-in dataset: its first {QUESTIONS} training questions drawn with seed 0 "
                             "(default: the paper's, obqa)")
    source.add_argument("--questions", help="a JSON list of {question, options, context, answer} instead")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer directory (default: the SmolLM2-135M-Instruct one the project ships)")
    parser.add_argument("--batch-size", type=int, default=PAPER_WORKLOAD["batch_size"],
                        help="questions per step (default: the paper's per-device batch, 4)")
    parser.add_argument("--steps", type=int, default=12,
                        help="timed steps per path and phase, alternating between the paths (after 2 warm-up); >= 2")
    parser.add_argument("--output", default="benchmarks/results/paper_scale_gpu.json")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="decoder layers recompute their activations in the backward pass (less memory)")
    parser.add_argument("--smoke", action="store_true", help="a 2-layer model on the CPU: checks the script runs")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu: the real widths on the CPU, slowly; "
                        "with --layers, for the activations a decoder layer keeps")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32, Llama3-8B's)")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the paths' speed ratio is a paired interval over steps), got {args.steps}")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")
    if args.smoke and args.layers is not None:
        parser.error(f"--smoke runs its own 2-layer model: --layers {args.layers} is not taken with it")
    if args.device not in ("cuda", "cpu"):
        parser.error(f"--device must be cuda or cpu, got {args.device!r}")
    global DEVICE
    if args.smoke or args.device == "cpu":
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    predictor, head, ids, batches = build(args)
    params = [p for p in predictor.model.parameters() if p.requires_grad] + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    weights = torch.nn.ModuleList([predictor.model, head])  # what saved_activation_bytes leaves out
    encoded = [predictor.encode(b) for b in batches]  # tokenised once: the real and padded tokens of each batch
    tokens = [int(e.attention_mask.sum()) / e.input_ids.shape[0] for e in encoded]
    padded = [e.input_ids.numel() for e in encoded]
    result = {"device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (smoke)" if args.smoke else "cpu",
              "cpu": cpu_features() if DEVICE == "cpu" else None,
              "layers": predictor.model.config.num_hidden_layers,
              "kept_batch_padded_tokens": padded[0],
              # every batch's (the timed steps take the first --steps): a step's activations grow with them
              "batch_padded_tokens": padded,
              "torch": torch.__version__, "model": "Llama3-8B shape, random bf16",
              "params_b": sum(p.numel() for p in predictor.model.parameters()) / 1e9, "batch_size": args.batch_size,
              "mean_prompt_tokens": sum(tokens) / len(tokens),
              "questions": Path(args.questions).name if args.questions else f"{args.dataset} {PAPER_WORKLOAD['split']}",
              "gradient_checkpointing": args.gradient_checkpointing,
              "paper": PAPER_H100, "paper_workload": PAPER_WORKLOAD, "paths": {}}
    result["rows_vs_full"] = {}
    for phase, train in (("train", True), ("test", False)):
        predictor.model.train(train)
        for path in PATHS:
            for b in batches[:2]:
                step(predictor, head, ids, b, path, optimizer, train)
        times, peaks = {p: [] for p in PATHS}, dict.fromkeys(PATHS, 0.0)
        for i in range(args.steps):
            for path in PATHS if i % 2 == 0 else PATHS[::-1]:
                reset_peak()
                times[path].append(step(predictor, head, ids, batches[i % len(batches)], path, optimizer, train))
                peaks[path] = max(peaks[path], peak_gb())
        for path in PATHS:
            entry = result["paths"].setdefault(path, {})
            entry[f"{phase}_samples_per_s"] = args.batch_size * len(times[path]) / sum(times[path])
            entry[f"{phase}_peak_memory_gb"] = peaks[path]
            if train:  # the activations autograd keeps for one step's backward pass (weights left out), any device
                entry["train_kept_activation_gb"] = saved_activation_bytes(
                    lambda path=path: step(predictor, head, ids, batches[0], path, optimizer, True), weights)[0] / 1e9
            # one more step under torch's profiler: launching operators (CPU) against running kernels (GPU)
            entry[f"{phase}_one_step_operators"] = operator_table(
                lambda path=path, train=train: step(predictor, head, ids, batches[0], path, optimizer, train), DEVICE)
            print(phase, path, json.dumps({k: v for k, v in entry.items() if "operators" not in k}), flush=True)
        # rows' samples/s over full's: full's step time over rows' on the same batches
        result["rows_vs_full"][f"{phase}_samples_per_s"] = paired_ratio(times["full"], times["rows"])
        result["rows_vs_full"][f"{phase}_peak_memory_gb"] = (peaks["rows"] / peaks["full"] if peaks["full"]
                                                             else None)
        write_result(args.output, result, echo=False)  # kept if the run is stopped before the next phase
    rows = result["paths"]["rows"]
    result["rows_vs_paper"] = {
        "train_samples_per_s": rows["train_samples_per_s"] / PAPER_H100["ib_edl_train_samples_per_s"],
        "test_samples_per_s": rows["test_samples_per_s"] / PAPER_H100["ib_edl_test_samples_per_s"],
        "train_peak_memory": rows["train_peak_memory_gb"] / PAPER_H100["ib_edl_peak_memory_gb"],
        "same_workload": same_workload(args, DEVICE),
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
