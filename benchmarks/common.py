"""What the benchmark scripts share: writing their results file, the CPU each speed figure was measured on, a
process's context switches and its threads' CPU time, and the paired ratio of two sets of times."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from ibedl.core.cpu_isa import cpu_flags, model_name, onednn_cap, usable_cores

REPO = Path(__file__).resolve().parents[1]  # the repository's root, where the benchmarks run as modules


def write_result(path: str | Path, result, echo: bool = True) -> Path:
    """Write ``result`` as indented JSON to ``path`` (parents created) and print it unless ``echo`` is false."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2) + "\n"
    path.write_text(text)
    if echo:
        print(text, end="")
    return path


def parse_sizes(text: str, flag: str) -> list[int]:
    """``"1,8"`` -> [1, 8]: the sizes a benchmark's ``flag`` lists; ValueError naming ``flag`` and a bad item."""
    sizes = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"{flag}: expected positive integers, got {item!r}")
        sizes.append(int(item))
    if not sizes:
        raise ValueError(f"{flag}: no size given")
    return sizes


def device_output(benchmark: str, device: str) -> str:
    """Where ``benchmark`` run on ``device`` writes by default: one file per kind of device
    (``benchmarks/results/<benchmark>_<cpu|cuda>.json``), so a GPU's run keeps the CPU's."""
    return f"benchmarks/results/{benchmark}_{device.split(':')[0]}.json"


def cuda_refusal(parser, device: str) -> int | None:
    """A benchmark's ``--device``: ``parser.error`` unless it is cpu or cuda[:i]; 2, after saying why, when it names
    CUDA and torch has none; else None (measure)."""
    if not (device == "cpu" or device.startswith("cuda")):
        parser.error(f"--device must be cpu or cuda[:i], got {device!r}")
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: --device {device}: no CUDA device (torch {torch.__version__})", file=sys.stderr)
        return 2
    return None


def served_questions(tokenizer, template: str, limit: int, dataset: str, needed: int, fewer: str) -> list:
    """The first ``needed`` of ``dataset``'s training questions (seed 0) whose whole prompt fits ``limit`` tokens, as
    the service would admit them (it refuses the others); ValueError saying how many fit and, in ``fewer``, which
    flags ask for less."""
    import itertools

    from ibedl.core.predictor import count_prompt_tokens
    from ibedl.training.data import load_dataset

    pool = load_dataset(dataset, "train", seed=0)
    questions = list(itertools.islice((q for q in pool if count_prompt_tokens(tokenizer, template, q) <= limit),
                                      needed))
    if len(questions) < needed:
        raise ValueError(f"only {len(questions)} of {len(pool)} {dataset} questions fit the service's {limit} "
                         f"tokens; {needed} needed: {fewer} or another --dataset")
    return questions


def cpu_features() -> dict:
    """The CPU's model name, the instruction sets the backends' speed depends on, oneDNN's instruction cap when one is
    set (the kernels then run an older CPU's code) and the cores this process may use: recorded with every speed
    figure. Read through :mod:`ibedl.core.cpu_isa`, the one place that parses the CPU."""
    flags = cpu_flags()
    isa = {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")}
    return {"model": model_name(), **isa, "onednn_cap": onednn_cap() or None, "cores": usable_cores()}


def voluntary_context_switches(pid: int | str = "self") -> int:
    """How often the threads of process ``pid`` have given up the CPU to wait: ``voluntary_ctxt_switches`` summed over
    ``/proc/<pid>/task/*/status`` (Linux; threads that have exited are not counted). A torch forward whose OpenMP
    workers sleep between parallel regions makes thousands a question, one whose workers spin a handful
    (ibedl.engine.engine.Engine keeps every torch call on one thread for that)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
        total += next(int(line.split()[1]) for line in status.splitlines()
                      if line.startswith("voluntary_ctxt_switches:"))
    return total


def thread_cpu_s(pid: int | str = "self") -> dict[int, float]:
    """CPU seconds (user and system) each live thread of process ``pid`` has used, by its native thread id, from
    ``/proc/<pid>/task/*/stat`` (Linux; clock-tick resolution, 10 ms on most kernels: sum a run of seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    used = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after the name, which may hold spaces; state is field 3
        used[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick  # utime and stime, fields 14 and 15
    return used


def cpu_by_thread_kind(named: dict[int, str] | None = None) -> dict[str, float]:
    """CPU seconds this process's live threads have used (:func:`thread_cpu_s`), summed by kind: a Python thread's
    name without its number (``ibedl-check``, ``MainThread``, ``AnyIO worker thread``), ``native`` for threads
    Python did not start (torch's, the tokenizers'); ``named`` gives native thread ids a kind of their own."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid, seconds in thread_cpu_s().items():
        name = names.get(tid)
        if named and tid in named:
            kind = named[tid]
        elif name is None:
            kind = "native"
        else:
            kind = name.split("_")[0].split(" (")[0].rstrip("-0123456789")
        out[kind] = out.get(kind, 0.0) + seconds
    return out


def paired_ratio(numerator, denominator, seed: int = 0) -> dict:
    """mean(numerator) / mean(denominator) of paired times, with a 95% paired bootstrap interval (scipy's BCa, 2,000
    resamples of the pairs; None for both ends where the pairs leave nothing to resample, e.g. every pair in one
    ratio)."""
    import warnings

    from scipy.stats import DegenerateDataWarning, bootstrap

    numerator, denominator = np.asarray(numerator, float), np.asarray(denominator, float)
    if numerator.ndim != 1 or numerator.shape != denominator.shape or numerator.size < 2:
        raise ValueError(f"two 1-D arrays of paired times of one length >= 2 needed, got shapes {numerator.shape} "
                         f"and {denominator.shape}")
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):  # a degenerate sample: NaN ends
        warnings.simplefilter("ignore", DegenerateDataWarning)  # (reported as None below)
        ci = bootstrap((numerator, denominator), lambda n, d, axis: n.mean(axis) / d.mean(axis), paired=True,
                       vectorized=True, n_resamples=2000, rng=np.random.default_rng(seed)).confidence_interval
    ends = [None if np.isnan(x) else float(x) for x in (ci.low, ci.high)]
    return {"ratio": float(numerator.mean() / denominator.mean()), "low": ends[0], "high": ends[1]}


def _device_us(event) -> float | None:
    """An event's own time on the device, microseconds (``self_cuda_time_total`` on torch before 2.4), or None."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return getattr(event, name)
    return None


def operator_table(run, device: str, top: int = 12, counts: bool = False) -> dict:
    """torch's profiler over one call of ``run``: the seconds of CPU time spent in operators (launching them,
    on a GPU) against the seconds the device's kernels ran (summed over the kernel events only, as torch's own
    table does: an operator's event carries its kernels' time too; None without CUDA or where this torch does not
    say), and the ``top`` operators by CPU time; with ``counts`` also every CPU operator's calls
    (``calls_by_operator``)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    on_device = [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    kernels = [_device_us(e) for e in on_device]
    kernel_s = sum(kernels) / 1e6 if cuda and None not in kernels else None
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    table = {"operator_cpu_s": sum(e.self_cpu_time_total for e in events) / 1e6, "kernel_s": kernel_s,
             "kernel_launches": sum(e.count for e in on_device) if cuda else None,
             "operator_calls": sum(e.count for e in events if e.device_type == DeviceType.CPU),
             "top_by_cpu": [{"name": e.key, "calls": e.count, "cpu_s": e.self_cpu_time_total / 1e6}
                            for e in rows]}
    if counts:
        table["calls_by_operator"] = {e.key: e.count for e in events if e.device_type == DeviceType.CPU}
    return table


def saved_activation_bytes(run, module) -> tuple[int, object]:
    """Bytes of the tensors autograd keeps for the backward pass while ``run()`` runs its forward (its activations),
    each storage counted once, the storages of ``module``'s parameters, trained or frozen, left out (a matmul keeps its
    weight, which memory holds anyway). A region under non-reentrant checkpointing keeps only its inputs: its own
    hooks take the tensors saved inside it, which it recomputes in the backward pass. Returns (those bytes, what
    ``run`` returned)."""
    import torch

    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights and t.device.type != "meta":
            kept[storage.data_ptr()] = storage.nbytes()
        # the values only: a tensor an operation saves may be its own output, whose grad_fn is the node keeping it,
        # and holding it whole would make a cycle that keeps the graph alive after the loss is dropped
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(kept.values()), out
