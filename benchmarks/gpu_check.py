"""The GPU path end to end on a lent CUDA machine, in one command that fits its time (``make gpu-check``):

    python -m benchmarks.gpu_check [--steps 60] [--batch-size 64] [--requests 2048] [--clients 64] [--batch-items 8]
        [--only train,calibrate,serve,serve_free,paper] [--budget train=200,...]
        [--output benchmarks/results/gpu_check.json]

1. ``train``: IB-EDL steps in fp32, bf16 and bf16 on a 4-bit NF4 base, in micro-batches of 64 (benchmarks.gpu_path:
   training samples/s and peak GPU memory of each, and test accuracy).
2. ``calibrate``: the committed default adapter calibrated by its own recipe (:data:`CALIBRATION`: per option
   count) on the arithmetic it will be served with (CUDA, bf16 on a 4-bit base: ``torch-cuda-nf4-bf16``; without
   bitsandbytes bf16 as loaded and with the adapter merged, ``torch-cuda-bf16`` and ``torch-cuda-merged-bf16``), and
   on the merged trunk replayed from CUDA graphs (``torch-cuda-graphs-bf16``), for ``auto`` to time them, into a copy
   under ``runs/gpu_check``.
3. ``serve``: that copy served on CUDA (``IBEDL_DEVICE=cuda``, ``IBEDL_LOAD_IN_4BIT=true`` where NF4 is): readiness,
   then ``auto``'s background measurement of the calibrated arithmetics (the clients start when it has ended, so
   one backend answers them, or :data:`MIN_SENDING_S` before the step must stop sending), the backend and the
   calibration the service reports it uses, answers/s and p50/p99 latency from 64 concurrent clients sending 2,048
   distinct SciQ questions (micro-batches of up to 64), refusals by reason, the passes the service ran (their count,
   mean questions and mean model time, from its ``/metrics``), and the GPU memory of the service process
   (nvidia-smi). Then (``batched``) the same clients send 2,048 other questions as ``POST /predict/batch``
   requests of ``--batch-items`` (8) each, what a client after throughput sends: each HTTP request costs the host's
   event loop about as much as a question's whole answer, so one-question requests measure the host as much as the
   card (docs/results.md#service-bound). When both rounds run, the first may send for half the sending time left.
4. ``serve_free``: the same with ``IBEDL_PAD_FREELY=true`` (a pass takes questions whatever their prompt lengths
   and runs as one forward: the length rules made for a CPU lifted) and, unless ``--batch-tokens`` says otherwise,
   ``IBEDL_MAX_BATCH_TOKENS`` of 1,024 padded tokens per client (so a pass may hold every client's question), so
   one run says which a GPU service should use.
5. ``paper``: the 8B-shaped throughput run (benchmarks.paper_scale_gpu, random bf16 Llama3-8B shape) on the
   paper's workload (OBQA training questions in batches of 4) beside its H100 figures: 68.08 test and 26.41 train
   samples/s, 21.88 GB peak.

Needs CUDA (a CUDA build of torch); without it, it exits 2 at once, saying why. Without bitsandbytes (the ``gpu``
extra) it still runs, calibrating and serving in bf16 as loaded, merged and graphed (``torch-cuda-bf16``,
``torch-cuda-merged-bf16``, ``torch-cuda-graphs-bf16``) with no NF4 training row, and its result says NF4 was not
measured. CI never runs it. Each
step runs in a child process under a time budget of its own (:data:`BUDGETS`, 450 s in all, so the check fits in 8
minutes with its start-up); a step still running when its
budget ends is killed (its process group: the service it started too) and recorded with what it had written so far
(``stopped_by_budget``). Each step's result is written as soon as it is known, so a run cut short by the machine's
time keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import write_result
from benchmarks.load_client import send_all

STEPS = ("train", "calibrate", "serve", "serve_free", "paper")
# Seconds each step may run (its child process included start-up, model loading and CUDA initialisation). The
# issue's bound is 8 minutes for the whole check; these sum to 450 s, leaving 30 s for the parent and slack. Train
# gets the most: three precisions, each loading the model, training, calibrating and evaluating 500 questions (two
# took 121 s on the H200, 64 and 50 s). Calibrate: one arithmetic took 34 s there; with bitsandbytes two run,
# without it three (the merged and graphed ones load the base twice: the predictor's and the trunk's). The paper step
# took 40 s. Serve waits for auto's background measurement first (below); serve_free starts on its cached winner,
# which, graphed, captures its 36 graphs before it is ready (each an eager warm-up, the capture and a check: seconds).
BUDGETS = {"train": 170, "calibrate": 100, "serve": 65, "serve_free": 60, "paper": 55}
WHOLE_CHECK_S = 480
# The serve step stops sending questions this long before its budget ends: time to read the GPU memory, stop the
# service and write what the clients got (a step killed at its budget keeps only what it had written).
SERVE_STOP_MARGIN_S = 15.0
# The serve step sends once auto's background measurement has ended (so one backend answers the clients), but no later
# than this long before it must stop sending; it asks the service how the measurement stands this often, each asking
# given at most CARD_TIMEOUT_S.
MIN_SENDING_S = 20.0
SETTLE_POLL_S = 0.5
CARD_TIMEOUT_S = 5.0
FREE_TOKENS_PER_CLIENT = 1024  # serve_free's padded tokens per pass, per client (the service's default max_tokens)
RUNS = Path("runs/gpu_check")


def missing_gpu() -> str | None:
    """Why this machine cannot run the check, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed: make setup"
    if not torch.cuda.is_available():
        return (f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}): run this on a lent "
                "GPU machine with a CUDA build of torch; CI never runs it")
    return None


# The default's calibration recipe (make calibrate-default's CALIBRATE; tests/benchmarks/test_gpu_check.py keeps the
# two equal): a CUDA service keeps the same promises, per option count, as the CPU backends.
CALIBRATION = ["--dataset", "sciq", "--split", "validation", "--option-counts", "2,3,4,5,6",
               "--ood-rejection-rate", "0.2", "--main-options", "4"]


def arithmetic(has_nf4: bool) -> dict:
    """What the calibrate and serve steps use: bf16 on a 4-bit NF4 base where bitsandbytes is installed (the
    smallest footprint, served with IBEDL_LOAD_IN_4BIT), else bf16 as loaded and the adapter merged into the bf16
    weights; and either way that merged trunk replayed from CUDA graphs (ibedl.core.backends.cuda_graphs, which
    launches a pass's kernels at once); each calibrated, so that IBEDL_BACKEND=auto times them and serves the
    fastest: a pass of a few
    questions is likely bound by dispatching operators, and merging halves them (on the H200 unmerged fp32's test
    passes ran 1.8x bf16's rate, fp32 having fewer operators: no casts to and from the adapter's float32; merged, the
    two precisions dispatch the same operators, and fp32's matmuls are not faster). ``make gpu-profiles`` times
    merged fp32 beside them (benchmarks.merged_adapter). The check still runs without NF4, and says it was not
    measured."""
    graphs = ("torch-cuda-graphs-bf16", ["--backend", "torch-cuda-graphs-bf16"])
    if has_nf4:
        return {"keys": ["torch-cuda-nf4-bf16", graphs[0]],
                "calibrate_flags": [["--dtype", "bfloat16", "--load-in-4bit"], graphs[1]],
                "serve_env": {"IBEDL_LOAD_IN_4BIT": "true"}}
    return {"keys": ["torch-cuda-bf16", "torch-cuda-merged-bf16", graphs[0]],
            "calibrate_flags": [["--dtype", "bfloat16"], ["--backend", "torch-cuda-merged-bf16"], graphs[1]],
            "serve_env": {}, "nf4": "not measured: bitsandbytes is not installed (pip install -e '.[gpu]')"}


def nf4_available() -> bool:
    """Whether bitsandbytes imports (installed but broken counts as absent)."""
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # noqa: BLE001  (a broken install raises more than ImportError)
        return False
    return True


RECORDED_PACKAGES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "numpy", "safetensors", "fastapi",
                     "uvicorn", "pydantic")


def package_versions() -> dict[str, str | None]:
    """The versions the check ran with (an offline install keeps the machine's own where it has them)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in RECORDED_PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def step_train(args, out: Path) -> dict:
    from benchmarks import gpu_path

    path = partial_path(out, "train")
    code = gpu_path.main(["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--output", str(path),
                          "--runs-dir", str(RUNS / "train"), *([] if nf4_available() else ["--without-4bit"])])
    return {"exit": code, **(json.loads(path.read_text()) if path.is_file() else {})}


def step_calibrate(args, out: Path) -> dict:
    from ibedl.core.artifact import read_manifest
    from ibedl.training import calibrate

    target = RUNS / "default-cuda"
    if target.exists():
        shutil.rmtree(target)
    use = arithmetic(nf4_available())
    seconds = {}
    for i, (key, flags) in enumerate(zip(use["keys"], use["calibrate_flags"], strict=True)):
        start = time.perf_counter()  # the first writes the copy, the next calibrate it in place
        where = ["--artifact", args.artifact, "--output", str(target)] if i == 0 else ["--artifact", str(target)]
        code = calibrate.main([*where, *CALIBRATION, "--device", "cuda", *flags, "--no-progress"])
        seconds[key] = round(time.perf_counter() - start, 1)
        if code != 0:
            return {"exit": code, "failed_on": key, "seconds_each": seconds}
        # what is done so far, kept should the budget stop the next arithmetic (the parent reads this file then)
        write_result(partial_path(out, "calibrate"), {"arithmetics": use["keys"], "seconds_each": seconds,
                                                      "done": list(seconds)}, echo=False)
    manifest = read_manifest(target)
    made = {}
    for key in use["keys"]:
        cal = manifest.calibration_for(key)
        made[key] = None if cal is None else {
            "min_confidence": cal.thresholds.min_confidence, "ood_threshold": cal.thresholds.ood_threshold,
            "how": cal.thresholds.how, "head": cal.head, "option_counts": sorted(cal.thresholds.by_options, key=int)}
    return {"exit": 0, "artifact": str(target), "arithmetics": use["keys"], "seconds_each": seconds,
            "calibrations": manifest.calibration_keys(), "made": made}


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


def step_serve(args, out: Path, pad_freely: bool = False) -> dict:
    import httpx

    from benchmarks.service_process import ServiceProcess
    from ibedl.training.data import load_dataset

    budget = parse_budgets(args.budget)["serve_free" if pad_freely else "serve"]
    send_until = time.monotonic() + budget - SERVE_STOP_MARGIN_S
    artifact = RUNS / "default-cuda"
    if not (artifact / "manifest.json").is_file():
        return {"skipped": "no CUDA-calibrated copy: run the calibrate step first"}
    rounds = [("one", 1)] + ([("batched", args.batch_items)] if args.batch_items > 1 else [])
    log = RUNS / ("serve_free.log" if pad_freely else "serve.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    # every client's request may wait at once: the batched round's clients have 8 questions each in flight, past the
    # service's default queue of 256 (QueueFull would measure admission, not the card)
    queue_size = max(args.clients * max(per_request for _, per_request in rounds), 256)
    env = {"IBEDL_DEVICE": "cuda", **arithmetic(nf4_available())["serve_env"], "IBEDL_BACKEND": "auto",
           "IBEDL_MAX_BATCH_SIZE": str(args.clients), "IBEDL_PAD_FREELY": str(pad_freely).lower(),
           "IBEDL_QUEUE_SIZE": str(queue_size)}
    batch_tokens = args.batch_tokens or (FREE_TOKENS_PER_CLIENT * args.clients if pad_freely else None)
    if batch_tokens is not None:
        env["IBEDL_MAX_BATCH_TOKENS"] = str(batch_tokens)
    proc = ServiceProcess(artifact, env, log)
    try:
        proc.wait_ready(timeout=budget)
        def get_card() -> dict | None:  # None: the service did not say in time (it is answering or measuring)
            try:
                return httpx.get(proc.url + "/v1/models", timeout=CARD_TIMEOUT_S).json()["data"][0]
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                return None

        ready = get_card()
        # distinct questions (SciQ training, with their passages), none in two rounds: a repeated question would
        # measure a cache. The first round's are the ones every earlier serve step sent; the second's come from a
        # larger draw, less those
        first = load_dataset("sciq", "train", limit=args.requests, seed=0)
        more = load_dataset("sciq", "train", limit=args.requests * (len(rounds) - 1), seed=1,
                            exclude={q.id for q in first}) if len(rounds) > 1 else []
        items = [{"question": q.question, "options": list(q.options), "context": q.context} for q in [*first, *more]]
        card, settled = settled_card(get_card, send_until - MIN_SENDING_S)
        with httpx.Client(timeout=120) as client:
            client.post(proc.url + "/predict", json=items[0])  # warm-up
            measured = client_rounds(client, proc.url, proc.port, items, rounds, args.clients, send_until)
        after = get_card()  # a measurement that had not ended may have switched the backend while the clients ran
        memory = gpu_memory_mib(proc.proc.pid)
    finally:
        stopped = proc.stop()
    return {"backend_at_ready": None if ready is None else ready["backend"]["name"], "measurement_ended": settled,
            "backend": card["backend"], "calibration_in_use": card["calibration_in_use"],
            # after the clients: None where the service did not give its card
            "backend_after": None if after is None else after["backend"],
            "calibration_after": None if after is None else after["calibration_in_use"],
            **measured["one"], "batched": measured.get("batched"), "clients": args.clients,
            "max_batch_tokens": batch_tokens, "queue_size": queue_size, "pad_freely": pad_freely,
            "gpu_memory_mib": memory,
            "exit_on_sigterm": stopped, "log": str(log)}


def client_rounds(client, url: str, port: int, items: list[dict], rounds: list[tuple[str, int]], clients: int,
                  send_until: float) -> dict:
    """Each round ``(name, questions a request)`` in turn: its own ``len(items) // len(rounds)`` of ``items`` sent by
    ``clients`` concurrent connections to the service at ``url`` (``port``), one a request (``POST /predict``) or
    several (``POST /predict/batch``; the round's questions that would not fill a last request are left out);
    :func:`serve_summary` of what they got, with the passes the service ran meanwhile (its ``/metrics`` read with
    ``client`` before and after). A round sends until ``time.monotonic()`` reaches ``send_until``, every round but
    the last until half the time left then."""
    each = len(items) // len(rounds)
    measured = {}
    for i, (name, per_request) in enumerate(rounds):
        mine = items[i * each:(i + 1) * each][:each // per_request * per_request]  # whole requests only
        bodies = mine if per_request == 1 else [{"items": mine[j:j + per_request]}
                                                for j in range(0, len(mine), per_request)]
        left = send_until - time.monotonic()
        until = time.monotonic() + (left / 2 if i + 1 < len(rounds) else left)
        before = read_passes(client, url)  # the warm-up's, start-up's and the last round's passes are not this one's
        # the clients: benchmarks.load_client (httpx's client took 8.8 ms of CPU a request and would be the bound); a
        # request past the round's sending time is not sent, a lost connection is one failed request
        start = time.perf_counter()
        sent = asyncio.run(send_all(port, "/predict" if per_request == 1 else "/predict/batch",
                                    [json.dumps(b).encode() for b in bodies], clients, until=until))
        seconds = time.perf_counter() - start
        answers = [None if a is None else (a[0], a[1], None if a[0] == 200 else
                                           a[2] if isinstance(a[2], str) else error_type(a[0], a[2]))
                   for a in sent]
        measured[name] = {**serve_summary(answers, seconds, per_request),
                          "passes": passes_between(before, read_passes(client, url))}
    return measured


def settled_card(get_card, until: float, clock=time.monotonic, wait=time.sleep) -> tuple[dict, bool]:
    """(the default adapter's card from ``get_card()``, whether ``auto``'s background measurement had ended): read
    until that measurement is done or failed (the backend then serving serves from then on; a card without one has
    nothing to measure) or until ``clock()`` reaches ``until`` (then the last card read), every
    :data:`SETTLE_POLL_S` seconds. ``get_card`` returns None when the service did not answer in time; TimeoutError
    when it gave no card at all by ``until`` (a service that stopped answering)."""
    card = None
    while True:
        read = get_card()
        card = read if read is not None else card
        if card is not None:
            background = card["backend"].get("background")
            if background is None or background.get("state") in ("done", "failed"):
                return card, True
        if clock() >= until:
            if card is None:
                raise TimeoutError("the service gave no card (GET /v1/models) before the clients were due to start")
            return card, False
        wait(SETTLE_POLL_S)


PASS_TOTALS = ("ibedl_batch_size_count", "ibedl_batch_size_sum", "ibedl_forward_seconds_sum")


def pass_totals(metrics_text: str) -> dict[str, float]:
    """The service's running totals of its forward passes, from its Prometheus text: passes, questions in them and
    model seconds (``ibedl_batch_size``, ``ibedl_forward_seconds``); 0 for what it has not exported."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(PASS_TOTALS, 0.0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] = sample.value
    return totals


def read_passes(client, url: str) -> dict[str, float] | str:
    """:func:`pass_totals` of the service at ``url`` now, or why they could not be read (the step keeps its answers)."""
    try:
        response = client.get(url + "/metrics")
        response.raise_for_status()
        return pass_totals(response.text)
    except Exception as e:  # noqa: BLE001  (a metrics failure must not lose what the clients measured)
        return f"{type(e).__name__}: {e}"


def passes_between(before: dict[str, float] | str, after: dict[str, float] | str) -> dict:
    """The passes run between two :func:`read_passes`: their count, mean questions and mean model milliseconds (None
    where none ran); ``{"error": why}`` where either reading failed."""
    if isinstance(before, str) or isinstance(after, str):
        return {"error": before if isinstance(before, str) else after}
    count = int(after["ibedl_batch_size_count"] - before["ibedl_batch_size_count"])
    questions = after["ibedl_batch_size_sum"] - before["ibedl_batch_size_sum"]
    seconds = after["ibedl_forward_seconds_sum"] - before["ibedl_forward_seconds_sum"]
    return {"count": count, "mean_questions": questions / count if count else None,
            "mean_forward_ms": 1000 * seconds / count if count else None}


def error_type(status: int, body: bytes) -> str:
    """The error type a refusal's body names (``overloaded``, ``not_ready``...), else its status code."""
    try:
        return str(json.loads(body)["error"]["type"])
    except (ValueError, KeyError, TypeError):
        return str(status)


def serve_summary(answers: list[tuple[int, float, str | None] | None], seconds: float,
                  per_request: int = 1) -> dict:
    """What the clients got from requests of ``per_request`` questions each: answers/s (answered questions over the
    wall time of all requests), the latency percentiles of the answered requests, refusals (429 and 503: the model
    never saw the request; by error type) apart from failures (any other status, or no response: by type); ``None``
    is a request not sent (the step's sending time was over), counted as ``not_sent``. ``requests``, ``answered``,
    ``refused`` and ``failed`` count requests."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if per_request < 1:
        raise ValueError(f"per_request must be >= 1, got {per_request}")
    not_sent = sum(a is None for a in answers)
    answers = [a for a in answers if a is not None]
    latencies = np.array([t for code, t, _ in answers if code == 200])
    refused: dict[str, int] = {}
    failed: dict[str, int] = {}
    for code, _, why in answers:
        if code != 200:
            tally = refused if code in (429, 503) else failed
            tally[why or str(code)] = tally.get(why or str(code), 0) + 1
    return {"requests": len(answers), "not_sent": not_sent, "answered": len(latencies), "refused": refused,
            "failed": failed, "questions_per_request": per_request,
            "answers_per_s": per_request * len(latencies) / seconds, "seconds": seconds,
            "latency_ms": None if not len(latencies) else {
                "p50": float(np.percentile(latencies, 50) * 1000), "p99": float(np.percentile(latencies, 99) * 1000)}}


def step_paper(args, out: Path) -> dict:
    from benchmarks import paper_scale_gpu

    path = partial_path(out, "paper")  # the paper's workload and the SmolLM2 tokenizer: paper_scale_gpu's defaults
    code = paper_scale_gpu.main(["--output", str(path)])
    result = json.loads(path.read_text()) if path.is_file() else {}
    rows = result.get("paths", {}).get("rows", {})
    return {"exit": code, "paper_h100": paper_scale_gpu.PAPER_H100, "measured_rows": rows,
            "vs_paper": result.get("rows_vs_paper"), "device": result.get("device"),
            "paper_scale_gpu": result}  # the whole run (both paths, the profiled steps): this file replaces it


def partial_path(out: Path, step: str) -> Path:
    """Where step ``step`` writes what it has measured so far (the train, calibrate and paper steps, as they go), beside
    ``out``: what is kept of a step its budget stopped."""
    return out.with_name(f"{out.stem}_{step}.json")


def parse_budgets(text: str | None) -> dict[str, float]:
    """:data:`BUDGETS` with ``name=seconds,...`` from ``text`` replacing some; ValueError naming a bad step or value."""
    budgets = dict(BUDGETS)
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        name, _, value = item.partition("=")
        if name not in BUDGETS:
            raise ValueError(f"--budget: unknown step {name!r}; choose among {', '.join(STEPS)}")
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"--budget: {name} must be a number of seconds, got {value!r}") from None
        if not seconds > 0:
            raise ValueError(f"--budget: {name} must be > 0 seconds, got {value!r}")
        budgets[name] = seconds
    return budgets


def run_budgeted(command: list[str], budget_s: float, partial: Path) -> dict:
    """Run ``command`` (a step's child process) for at most ``budget_s`` seconds: its result is the JSON it wrote to
    ``partial``; past its budget its process group is killed (a service it started with it) and the result is what
    ``partial`` held then, marked ``stopped_by_budget``. A child that wrote nothing gives an ``error``; one that wrote
    and then exited non-zero (failed after a partial result) is marked with its ``process_exit``."""
    if budget_s <= 0:
        raise ValueError(f"budget_s must be > 0, got {budget_s}")
    partial.unlink(missing_ok=True)
    proc = subprocess.Popen(command, start_new_session=True)  # its own group: killed whole at the budget
    stopped = False
    try:
        proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        stopped = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    try:
        result = json.loads(partial.read_text())
    except (OSError, ValueError):
        result = {}
    if stopped:
        return {**result, "stopped_by_budget": budget_s}
    if not result:
        return {"error": f"the step's process exited {proc.returncode} without writing {partial}"}
    return result if proc.returncode == 0 else {**result, "process_exit": proc.returncode}


def run_step(name: str, args, out: Path) -> int:
    """The child's side: run step ``name`` in this process and write its result to its partial path."""
    run = {"train": step_train, "calibrate": step_calibrate, "serve": step_serve,
           "serve_free": lambda args, out: step_serve(args, out, pad_freely=True), "paper": step_paper}
    try:
        result = run[name](args, out)
    except Exception as e:  # noqa: BLE001  (one step's failure is recorded; the next steps still run)
        result = {"error": f"{type(e).__name__}: {e}"}
    write_result(partial_path(out, name), result, echo=False)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="artifacts/default")
    parser.add_argument("--steps", type=int, default=60, help="training steps per precision (default 60)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="training micro-batch on the GPU (default 64; the recipe's 8 leaves an H100 idle)")
    parser.add_argument("--requests", type=int, default=2048,
                        help="distinct SciQ training questions sent to the CUDA service (default 2048)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients of the serve step (default 64)")
    parser.add_argument("--batch-items", type=int, default=8,
                        help="questions a request in the serve steps' second round of --requests other questions, "
                        "sent as POST /predict/batch (default 8; 1: no second round)")
    parser.add_argument("--batch-tokens", type=int,
                        help="the service's IBEDL_MAX_BATCH_TOKENS in the serve step (default: the service's)")
    parser.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps among {', '.join(STEPS)}")
    parser.add_argument("--budget", help="seconds per step, e.g. train=300,paper=60 (default "
                        + ",".join(f"{k}={v}" for k, v in BUDGETS.items()) + ")")
    parser.add_argument("--output", default="benchmarks/results/gpu_check.json")
    parser.add_argument("--run-step", choices=STEPS, help=argparse.SUPPRESS)  # the child process of one step
    args = parser.parse_args(argv)
    steps = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        parser.error(f"unknown steps {unknown}; choose among {', '.join(STEPS)}")
    for flag in ("steps", "batch_size", "requests", "clients", "batch_items", "batch_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    try:
        budgets = parse_budgets(args.budget)
    except ValueError as e:
        parser.error(str(e))
    out = Path(args.output)
    if args.run_step:
        return run_step(args.run_step, args, out)
    why = missing_gpu()
    if why is not None:
        print(f"error: make gpu-check needs a GPU: {why}", file=sys.stderr)
        return 2
    import torch

    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "packages": package_versions(),
              "arithmetic": arithmetic(nf4_available()),
              "command": shlex.join(["python", "-m", "benchmarks.gpu_check",
                                     *(argv if argv is not None else sys.argv[1:])]),
              "budgets_s": {name: budgets[name] for name in steps}, "steps": {}}
    child = [sys.executable, "-m", "benchmarks.gpu_check", *(argv if argv is not None else sys.argv[1:])]
    failed = False
    for name in steps:
        start = time.perf_counter()
        result["steps"][name] = run_budgeted([*child, "--run-step", name], budgets[name], partial_path(out, name))
        result["steps"][name]["seconds"] = round(time.perf_counter() - start, 1)
        failed |= ("error" in result["steps"][name] or result["steps"][name].get("exit", 0) != 0
                   or "process_exit" in result["steps"][name])
        write_result(out, result, echo=False)
        print(f"{name}: {json.dumps(result['steps'][name])[:400]}", flush=True)
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
