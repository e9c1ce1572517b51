"""Inference backends on the CPU, judged by their decisions: speed against torch fp32 in one process, the memory of a
service on each backend, and what each backend decides under its own calibration.

    python -m benchmarks.cpu_backends [--artifact artifacts/default] [--questions 200] [--limit N] \
        [--backends torch openvino-fp32 openvino-bf16 openvino openvino-int8] [--splits 200] \
        [--output benchmarks/results/cpu_backends.json]
    python -m benchmarks.cpu_backends --service [--questions 64] [--backends ...]

``--service``: the same backends through the real service, one ``python -m ibedl.serve`` per backend (IBEDL_BACKEND
named, IBEDL_BACKEND_SWITCHING=false), all started at once and asked in turn, question by question, so only one
computes at a time and every ratio to torch is of the same minutes: the first ``--questions`` of SciQ test (with
passages, varied lengths) as single POST /predict requests (p50/p99 latency) and as POST /predict/batch batches of 8
(p50/p99 per batch, questions/s), each GFLOP/s at the single-request p50 as a fraction of its precision's measured
peak; each backend's mean-time speed-up over torch paired question by question and batch by batch with its 95%
bootstrap interval, the raw seconds, and each service's voluntary context switches per question. Merged into the
result file under ``service`` (the in-process figures stay where they are).

Speed: on the first ``--questions`` of a seed-0 draw of SciQ test (with passages) the backends run interleaved
question by question in one process: p50/p99 latency at batch 1, throughput at batch 8, both as ratios to torch
fp32; the GFLOP/s each reaches at p50 as a fraction of the matrix-product peak of the precision it computes in (fp32,
bf16, int8: measured here by :func:`peaks`), and where a batch-1 answer's time goes (tokenising, trunk, head).

Memory: each backend loaded alone in a fresh process, as the service loads it (an OpenVINO backend drops the torch
model once the weights are checked): resident memory once loaded, after a warm-up answer, and the process's peak.

Decisions: each backend's raw outputs on SciQ validation (the calibration sample of the committed artifact, as
``python -m ibedl.training.calibrate`` reads it) and SciQ test. Each backend is calibrated on its own validation
outputs with the artifact's calibration settings (the code, sample and seed its stored calibration came from), and
judged on test under that calibration: accuracy, ECE, NLL, share answered and their accuracy, the conformal set's
coverage and size, and over ``--splits`` random halvings of test (benchmarks.decisions.repeated_splits) how often the
accuracy guarantee held and the sets' mean coverage. ``--limit N`` takes a seeded N of each split (and at most N
speed questions): a smoke test, not a measurement. ``openvino-int8`` (static int8, the ``int8`` extra) is quantised
on the artifact's quantisation sample (300 SciQ training questions for the default); a backend this machine cannot
run is reported as skipped, with why. The done-when block judges the backend ``auto`` picks here, measured afresh as
a first start measures it (ibedl.core.auto_backend).

Run it on an otherwise idle CPU: the backends share the cores with whatever else runs, and only the ratios within
one process are comparable between machines.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import cpu_features, paired_ratio, voluntary_context_switches, write_result
from benchmarks.decisions import repeated_splits, served, stream_row
from ibedl.core import auto_backend
from ibedl.core.backends import Built, build_trunk, calibration_key, get, unavailable
from ibedl.core.base_model import KNOWN_MODELS, MARKER, known_gguf, resolve_model
from ibedl.core.predictor import Predictor
from ibedl.core.prompt import format_prompt
from ibedl.training import metrics
from ibedl.training.calibrate import CalibrationConfig, calibrate_outputs, raw_outputs
from ibedl.training.data import load_dataset

BACKENDS = ("torch", "openvino-fp32", "openvino-bf16", "openvino", "openvino-int8")
SERVED_MAX_TOKENS = 1024  # the service's IBEDL_MAX_TOKENS: prompts are read whole, as served and calibrated
SPLIT_QUESTIONS = 20  # batch-1 questions timed part by part (tokenise, trunk, head)
# What the "done when" asks of the default backend against torch fp32 on this machine.
DONE_WHEN = {"throughput_vs_torch": 2.0, "accuracy_points_within": 1.0, "guarantee_share": 0.9,
             "coverage_points_within": 2.0}


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


def best_seconds(run, seconds: float) -> float:
    """The fastest of repeated calls of ``run`` over ``seconds`` (after one warm-up call)."""
    run()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def peaks(seconds: float = 2.0, n: int = 2048) -> dict:
    """GFLOP/s of an n x n x n matrix product in each precision on the cores this process may use: fp32 and bf16
    through torch.mm (oneDNN: AVX-512 FMA, AVX512-BF16/AMX where present), int8 through torch._int_mm (int8 x int8 ->
    int32: VNNI where present); None where this torch has no such kernel. The nominal fp32 figure (2 FMA pipes x
    16 lanes at the clock /proc/cpuinfo reports) is beside it: boost clocks run above it."""
    info = Path("/proc/cpuinfo").read_text().splitlines()
    mhz = max(float(line.split(":")[1]) for line in info if line.startswith("cpu MHz"))
    cores = len(os.sched_getaffinity(0))
    flop = 2 * n**3
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = {"cores": cores, "mhz": mhz, "nominal_fp32_gflops": cores * mhz / 1e3 * 32, "n": n}
    out["fp32"] = flop / best_seconds(lambda: torch.mm(a, b), seconds) / 1e9
    try:
        a16, b16 = a.bfloat16(), b.bfloat16()
        out["bf16"] = flop / best_seconds(lambda: torch.mm(a16, b16), seconds) / 1e9
    except RuntimeError:
        out["bf16"] = None
    try:
        a8, b8 = torch.randint(-128, 127, (n, n), dtype=torch.int8), torch.randint(-128, 127, (n, n), dtype=torch.int8)
        out["int8"] = flop / best_seconds(lambda: torch._int_mm(a8, b8), seconds) / 1e9
    except (RuntimeError, AttributeError):
        out["int8"] = None
    out["measured_by"] = "best n x n torch.mm (fp32, bf16) and torch._int_mm (int8) over the given seconds"
    return out


def peak_of(backend: str, peak: dict) -> tuple[str, float | None]:
    """(precision, GFLOP/s peak) a backend's matmuls compute in."""
    precision = {"torch": "fp32", "openvino-int8": "int8"}.get(backend, {"bf16": "bf16"}.get(get(backend).precision,
                                                                                             "fp32"))
    return precision, peak.get(precision)


def time_split(predictor, questions) -> dict:
    """Median seconds of a batch-1 answer's parts: tokenising, the trunk, the head."""
    parts = {"tokenise_s": [], "trunk_s": [], "head_s": []}
    for q in questions:
        t0 = time.perf_counter()
        batch = predictor.encode([q])
        t1 = time.perf_counter()
        hidden = predictor.hidden(batch)
        t2 = time.perf_counter()
        predictor.head(hidden, batch.option_mask)
        t3 = time.perf_counter()
        for key, value in zip(parts, (t1 - t0, t2 - t1, t3 - t2), strict=False):
            parts[key].append(value)
    medians = {k: float(np.median(v)) for k, v in parts.items()}
    total = sum(medians.values())
    return {**medians, **{k.replace("_s", "_share"): v / total for k, v in medians.items()}}


def speed(predictor, trunks: dict, questions, peak: dict, config) -> dict:
    """Batch-1 latency and batch-8 throughput of each backend, interleaved question by question (``config``: the
    base model's, for the FLOP count)."""
    names = list(trunks)

    def use(name):
        predictor.trunk, predictor.backend = trunks[name], name

    tokens = [len(predictor._encode_one(i, q, True)) for i, q in enumerate(questions)]
    seq = float(np.mean(tokens))
    gflop = gflop_per_token(config, seq) * seq
    for name in names:  # warm-up
        use(name)
        predictor.predict(questions[:2])
    latency = {n: [] for n in names}
    for q in questions:
        for name in names:
            use(name)
            start = time.perf_counter()
            predictor.predict([q])
            latency[name].append(time.perf_counter() - start)
    busy = {n: 0.0 for n in names}
    for i in range(0, len(questions), 8):
        for name in names:
            use(name)
            start = time.perf_counter()
            predictor.predict(questions[i: i + 8])
            busy[name] += time.perf_counter() - start
    rows = {}
    for name in names:
        use(name)
        p50 = float(np.percentile(latency[name], 50))
        precision, top = peak_of(name, peak)
        rows[name] = {
            "latency_p50_s": p50, "latency_p99_s": float(np.percentile(latency[name], 99)),
            "batch8_questions_per_s": len(questions) / busy[name], "gflops_at_p50": gflop / p50,
            "precision": precision, "fraction_of_own_peak_at_p50": None if not top else gflop / p50 / top,
            "time_split_batch1": time_split(predictor, questions[:SPLIT_QUESTIONS]),
        }
    base = rows.get("torch")
    for r in rows.values():
        if base is not None:
            r["p50_speedup_vs_torch"] = base["latency_p50_s"] / r["latency_p50_s"]
            r["throughput_vs_torch"] = r["batch8_questions_per_s"] / base["batch8_questions_per_s"]
    return {"questions": len(questions), "mean_prompt_tokens": seq, "gflop_per_question": gflop, "backends": rows}


def decisions(manifest, key: str, kind: str, val: dict, test: dict, splits: int) -> dict:
    """One backend judged on SciQ test under its own calibration, made on its SciQ validation outputs with the
    artifact's calibration settings. ``val``, ``test``: raw outputs with ``labels``."""
    stored = manifest.calibration_for(key)  # its own settings (e.g. the main option count), else the top level's
    cal = stored.record if stored is not None and stored.record.get("config") else manifest.calibration
    config = CalibrationConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cal.get("config", {}).items()})
    head_update, _, sections = calibrate_outputs(kind, val, val["labels"], config)
    mine = copy.deepcopy(manifest)
    mine.set_calibration(key, head_update, sections)
    calibration = mine.calibration_for(key)
    dump = {"kind": kind, "offset": test["offset"], "streams": {"sciq_test": test}}
    s = served(dump, "sciq_test", mine, key)
    quality = metrics.summarise(s["outputs"].probs, s["labels"], s["outputs"].uncertainty)
    row = stream_row(s, calibration.conformal)
    return {
        "calibration": {"n": len(val["labels"]), "head": head_update,
                        "min_confidence": calibration.thresholds.min_confidence,
                        "ood_threshold": calibration.thresholds.ood_threshold,
                        "certified": calibration.thresholds.how.get("certified"),
                        "stored_in_artifact": None if stored is None else {
                            "min_confidence": stored.thresholds.min_confidence,
                            "ood_threshold": stored.thresholds.ood_threshold}},
        "test": {"n": len(test["labels"]), **{k: quality[k] for k in ("accuracy", "ece", "nll")},
                 **{k: row.get(k) for k in ("answered", "answered_accuracy", "abstained_out_of_distribution",
                                            "abstained_min_confidence", "set_coverage", "set_mean_size")},
                 "set_nominal_coverage": None if calibration.conformal is None else 1 - calibration.conformal.alpha},
        "repeated_splits": repeated_splits(s, mine, splits, key=key),
        "probs": [list(map(float, p)) for p in s["outputs"].probs],  # for agreement with torch; dropped later
    }


def memory_of(backend: str, artifact: str) -> dict:
    """Resident memory of a fresh process serving ``backend`` alone (as the service loads it), after one answer."""
    cmd = [sys.executable, "-m", "benchmarks.cpu_backends", "--rss-of", backend, "--artifact", artifact]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"skipped": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def rss_of(backend: str, artifact: str) -> int:
    """The --rss-of mode: load ``backend`` through the engine as the service does (weights checked, an OpenVINO
    backend's torch model dropped; a backend without a calibration served with the artifact's first), answer once,
    print the memory as JSON. openvino-int8's IR must be cached already (the main process quantised it)."""
    from ibedl.engine.runtime import load_predictors, make_runtimes
    from ibedl.engine.settings import EngineSettings

    before = rss_mib()
    settings = EngineSettings(artifact=Path(artifact), backend=backend, max_tokens=SERVED_MAX_TOKENS,
                              allow_uncalibrated_backend=True)
    (runtime,) = make_runtimes(load_predictors(settings), settings).values()
    loaded = rss_mib()
    runtime.predict(load_dataset("sciq", "test", limit=4, seed=0))
    print(json.dumps({"rss_mib": rss_mib(), "peak_rss_mib": rss_mib("VmHWM"), "python_and_imports_mib": before,
                      "loaded_mib": loaded, "torch_model_released": runtime.predictor.model is None}))
    return 0


def done_when(manifest, predictor, rows: dict, artifact: Path, sha: str, trunks: dict) -> dict:
    """The issue's bar for the backend ``auto`` picks here (measured afresh, as a first start does) against torch
    fp32."""
    predictor.serve_on(Built(None, "torch"))
    choice, _ = auto_backend.choose(predictor, artifact, sha, fresh=True, unavailable=unavailable,
                                    build=lambda name: trunks[name] if name in trunks else
                                    build_trunk(name, predictor, artifact, sha).trunk)
    chosen, reason = choice.backend, f"{choice.reason}; skipped: {choice.skipped or 'none'}"
    mine, ref = rows.get(chosen, {}), rows.get("torch", {})
    if "decisions" not in mine or "decisions" not in ref or "speed" not in mine:
        return {"auto": chosen, "reason": reason, "judged": False, "why": "not measured in this run"}
    d, splits = mine["decisions"], mine["decisions"]["repeated_splits"]
    sets = splits["sets"][manifest.calibration.get("config", {}).get("score", "lac")]  # the score served by default
    nominal, coverage = sets["nominal"], sets["mean_coverage"]
    checks = {
        "throughput_vs_torch": mine["speed"].get("throughput_vs_torch"),
        "accuracy_points_vs_torch": 100 * (d["test"]["accuracy"] - ref["decisions"]["test"]["accuracy"]),
        "guarantee_share": splits["risk"]["share_of_splits_guarantee_held"],
        "coverage_points_vs_nominal": 100 * (coverage - nominal),
    }
    met = (checks["throughput_vs_torch"] >= DONE_WHEN["throughput_vs_torch"]
           and abs(checks["accuracy_points_vs_torch"]) <= DONE_WHEN["accuracy_points_within"]
           and checks["guarantee_share"] >= DONE_WHEN["guarantee_share"]
           and abs(checks["coverage_points_vs_nominal"]) <= DONE_WHEN["coverage_points_within"])
    return {"auto": chosen, "reason": reason, "judged": True, "bar": DONE_WHEN, **checks, "met": met}


SERVICE_BATCH = 8  # a client-sized POST /predict/batch


def service_summary(measured: dict, peak: dict, gflop_per_question: float) -> dict:
    """Per backend, from the seconds of its single requests (``single_s``) and of its batches of
    ``SERVICE_BATCH`` (``batch_s``, each with its question count in ``batch_sizes``): p50/p99, questions/s, the
    ratios to torch's (when torch was measured; the mean times' also paired question by question and batch by batch,
    with a 95% bootstrap interval: the batch one's ratio is ``batch_throughput_vs_torch``, the interval is what it
    adds; None where either service refused a request, as a refusal's time is not an answer's), the GFLOP/s at the
    single-request p50 as a fraction of the peak of the precision the backend computes in (``peak``: :func:`peaks`),
    and the seconds themselves (``seconds``)."""
    rows = {}
    for name, m in measured.items():
        if "skipped" in m:
            rows[name] = m
            continue
        single, batch = m["single_s"], m["batch_s"]
        p50 = float(np.percentile(single, 50))
        precision, top = peak_of(name, peak)
        rows[name] = {
            "single_p50_s": p50, "single_p99_s": float(np.percentile(single, 99)),
            "single_questions_per_s": len(single) / sum(single),
            "batch_p50_s": float(np.percentile(batch, 50)), "batch_p99_s": float(np.percentile(batch, 99)),
            "batch_questions_per_s": sum(m["batch_sizes"]) / sum(batch),
            "precision": precision, "gflops_at_single_p50": gflop_per_question / p50,
            "fraction_of_own_peak_at_single_p50": None if not top else gflop_per_question / p50 / top,
            **{k: v for k, v in m.items() if k not in ("single_s", "batch_s", "batch_sizes")},
            "seconds": {"single": list(single), "batch": list(batch), "batch_sizes": list(m["batch_sizes"])},
        }
    base = rows.get("torch")
    if base is not None and "skipped" not in base:
        for r in rows.values():
            if "skipped" in r:
                continue
            r["single_p50_speedup_vs_torch"] = base["single_p50_s"] / r["single_p50_s"]
            r["single_p99_speedup_vs_torch"] = base["single_p99_s"] / r["single_p99_s"]
            r["batch_throughput_vs_torch"] = r["batch_questions_per_s"] / base["batch_questions_per_s"]
            r["batch_p99_speedup_vs_torch"] = base["batch_p99_s"] / r["batch_p99_s"]
            if r is not base:  # torch's mean time over this backend's, on the same questions and batches
                refused = base.get("non_200", 0) + r.get("non_200", 0)
                for kind in ("single", "batch"):
                    pairs = base["seconds"][kind], r["seconds"][kind]
                    r[f"{kind}_mean_speedup_vs_torch"] = None if refused or len(pairs[0]) < 2 else paired_ratio(*pairs)
    return rows


def asked(client, server, path: str, body: dict):
    """(seconds, response, voluntary context switches of the service meanwhile) of one POST to ``server``; the
    switches are read outside the timed window and include the service's idle wake-ups (its shutdown watch wakes
    every 50 ms: about 20 a second, against thousands a question where torch's OpenMP workers sleep)."""
    before = voluntary_context_switches(server.proc.pid)
    start = time.perf_counter()
    response = client.post(server.url + path, json=body)
    seconds = time.perf_counter() - start
    return seconds, response, voluntary_context_switches(server.proc.pid) - before


def through_service(names: list[str], artifact: str, n: int) -> dict:
    """Every backend in ``names`` through its own service process (started together, asked in turn): the raw
    seconds of single requests and of batches of ``SERVICE_BATCH``, and each service's voluntary context switches per
    question of each kind (:func:`asked`)."""
    import httpx

    from benchmarks.service_process import ServiceProcess

    questions = load_dataset("sciq", "test", limit=n, seed=0)
    payloads = [{"question": q.question, "options": list(q.options), "context": q.context} for q in questions]
    servers, measured = {}, {}
    for name in names:
        servers[name] = ServiceProcess(artifact, {"IBEDL_BACKEND": name, "IBEDL_BACKEND_SWITCHING": "false",
                                                  "IBEDL_MAX_TOKENS": str(SERVED_MAX_TOKENS)},
                                       log_path=f"/tmp/ibedl-service-{name}.log")
    try:
        for name, server in servers.items():
            try:
                server.wait_ready(timeout=900)
            except AssertionError as e:
                measured[name] = {"skipped": str(e)[-400:]}
        live = {k: v for k, v in servers.items() if k not in measured}
        with httpx.Client(timeout=300) as client:
            for name, server in live.items():  # warm-up: a single and a batch each, once the service admits them
                for path, body in (("/predict", payloads[0]), ("/predict/batch", {"items": payloads[:SERVICE_BATCH]})):
                    for _ in range(60):  # a cold service's admission estimate may refuse (503) at first
                        if client.post(server.url + path, json=body).status_code == 200:
                            break
                        time.sleep(1)
                measured[name] = {"single_s": [], "batch_s": [], "batch_sizes": [], "non_200": 0,
                                  "answered_by": None, "switches": {"single": 0, "batch": 0}}
            for p in payloads:
                for name, server in live.items():
                    seconds, r, switches = asked(client, server, "/predict", p)
                    measured[name]["single_s"].append(seconds)
                    measured[name]["switches"]["single"] += switches
                    measured[name]["non_200"] += r.status_code != 200
                    if r.status_code == 200:
                        measured[name]["answered_by"] = {k: r.json()["adapter"][k] for k in ("backend", "calibration")}
            for i in range(0, len(payloads), SERVICE_BATCH):
                items = payloads[i: i + SERVICE_BATCH]
                for name, server in live.items():
                    seconds, r, switches = asked(client, server, "/predict/batch", {"items": items})
                    measured[name]["batch_s"].append(seconds)
                    measured[name]["switches"]["batch"] += switches
                    measured[name]["batch_sizes"].append(len(items))
                    measured[name]["non_200"] += r.status_code != 200
        for name, server in live.items():
            switches = measured[name].pop("switches")
            measured[name]["voluntary_context_switches_per_question"] = {
                "single": switches["single"] / len(payloads), "batch": switches["batch"] / len(payloads)}
            measured[name]["service_rss_mib"] = server.rss_mib()
            measured[name]["service_peak_rss_mib"] = int(next(
                line.split()[1] for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines()
                if line.startswith("VmHWM:"))) / 1024
    finally:
        for server in servers.values():
            server.stop()
    return {"questions": questions, "measured": measured}


def service_main(args, argv) -> int:
    """The --service mode: measure through the service and merge under ``service`` in the result file."""
    names = ["torch", *[b for b in args.backends if b != "torch"]]
    run = through_service(names, args.artifact, args.questions)
    predictor = Predictor.from_artifact(args.artifact)  # for the prompt lengths and the FLOP count only
    predictor.max_tokens = SERVED_MAX_TOKENS
    tokens = [len(predictor._encode_one(i, q, True)) for i, q in enumerate(run["questions"])]
    seq = float(np.mean(tokens))
    gflop = gflop_per_token(predictor.model.config, seq) * seq
    del predictor
    peak = peaks()
    path = Path(args.output)
    result = json.loads(path.read_text()) if path.exists() else {}
    if "backends" in result and "in_process_measured_on" not in result:
        result["in_process_measured_on"] = {"cpu": result.get("cpu"), "note": "the top-level speed, backends and "
                                            "peak_gflops figures were measured in one process (not through the "
                                            "service) on this CPU"}
    result["service"] = {
        "note": "one service process per backend (IBEDL_BACKEND named, switching off), started together and asked in "
                "turn question by question on loopback: compare the ratios to torch, measured in the same run",
        "command": "python -m benchmarks.cpu_backends " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cpu": cpu_features(), "cores": len(os.sched_getaffinity(0)), "peak_gflops": peak,
        "split": "sciq test, seed 0, with passages", "questions": len(run["questions"]),
        "prompt_tokens": {"mean": seq, "min": int(min(tokens)), "max": int(max(tokens))},
        "gflop_per_question": gflop, "batch_size": SERVICE_BATCH,
        "backends": service_summary(run["measured"], peak, gflop),
    }
    write_result(path, result, echo=False)
    print(json.dumps(result["service"], indent=2))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_backends", description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="artifacts/default")
    parser.add_argument("--questions", type=int, default=200, help="SciQ test questions timed (default 200)")
    parser.add_argument("--limit", type=int, help="a seeded subset of this size of SciQ validation and test for the "
                        "decisions, and at most this many timed questions: a smoke test (default: all of both)")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS,
                        help="backends to judge; torch (the reference) is always added first")
    parser.add_argument("--splits", type=int, default=200, help="random halvings of test checking the guarantee")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-backend memory processes")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp reference")
    parser.add_argument("--output", default="benchmarks/results/cpu_backends.json")
    parser.add_argument("--service", action="store_true", help="measure through the service instead (one process "
                        "per backend; --questions SciQ test questions, singles and batches of 8), merged under service")
    parser.add_argument("--rss-of", choices=[*BACKENDS, "auto"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_of:
        return rss_of(args.rss_of, args.artifact)
    for name in ("questions", "limit", "splits"):
        value = getattr(args, name)
        if value is not None and value < 2:
            parser.error(f"--{name} must be >= 2, got {value}")
    if args.service:
        return service_main(args, argv)
    names = ["torch", *[b for b in args.backends if b != "torch"]]
    timed = load_dataset("sciq", "test", limit=min(args.questions, args.limit or args.questions), seed=0)
    val = load_dataset("sciq", "validation", limit=args.limit, seed=0)
    test = load_dataset("sciq", "test", limit=args.limit, seed=0)
    artifact = Path(args.artifact)
    predictor = Predictor.from_artifact(artifact)
    predictor.max_tokens = SERVED_MAX_TOKENS
    manifest = predictor.manifest
    sha = resolve_model(manifest.base_model_ref().ref).sha256
    rows: dict[str, dict] = {}
    trunks = {}
    for name in names:
        start = time.perf_counter()
        try:
            trunks[name] = build_trunk(name, predictor, artifact, sha).trunk  # int8: on the artifact's sample
        except (ImportError, ValueError, RuntimeError) as e:
            rows[name] = {"skipped": f"{type(e).__name__}: {e}"}
            print(f"{name}: skipped ({e})", file=sys.stderr, flush=True)
            continue
        rows[name] = {"load_s": time.perf_counter() - start}
        if trunks[name] is not None:  # what the IR is (static int8: how many questions quantised it)
            rows[name]["export"] = json.loads((trunks[name].path / MARKER).read_text())
    peak = peaks()
    timing = speed(predictor, trunks, timed, peak, predictor.model.config)
    for name, r in timing["backends"].items():
        rows[name]["speed"] = r
    for name in trunks:
        predictor.trunk, predictor.backend = trunks[name], name
        key = calibration_key(name) if name != "torch" else predictor.calibration_key
        outputs = {}
        for split, questions in (("validation", val), ("test", test)):
            kind, raw = raw_outputs(predictor, questions, 8, progress=False)
            outputs[split] = {**raw, "labels": [q.answer for q in questions]}
        rows[name]["calibration_key"] = key
        rows[name]["decisions"] = decisions(manifest, key, kind, outputs["validation"], outputs["test"], args.splits)
        print(f"{name}: test accuracy {rows[name]['decisions']['test']['accuracy']:.3f}, answered "
              f"{rows[name]['decisions']['test']['answered']:.3f}", file=sys.stderr, flush=True)
    predictor.trunk, predictor.backend = trunks.get("torch"), "torch"
    ref = rows["torch"]["decisions"].pop("probs")
    for name in trunks:
        if name == "torch":
            continue
        probs = rows[name]["decisions"].pop("probs")
        rows[name]["decisions"]["vs_torch"] = {
            "same_answer": float(np.mean([np.argmax(a) == np.argmax(b) for a, b in zip(probs, ref, strict=True)])),
            "max_abs_prob_diff": float(max(np.abs(np.subtract(a, b)).max() for a, b in zip(probs, ref, strict=True)))}
    if not args.no_memory:
        for name in trunks:
            rows[name]["memory"] = memory_of(name, str(artifact))
    result = {
        "note": "one process, backends interleaved question by question: compare the ratios; memory from a fresh "
                "process per backend; decisions under each backend's own calibration (made on its SciQ validation "
                "outputs with the artifact's calibration settings)",
        "command": "python -m benchmarks.cpu_backends " + " ".join(argv if argv is not None else sys.argv[1:]),
        "smoke_test": args.limit is not None,
        "split": "sciq, seed 0, with passages", "validation_questions": len(val), "test_questions": len(test),
        "splits": args.splits, "cpu": cpu_features(), "peak_gflops": peak, "torch_threads": torch.get_num_threads(),
        "speed": {k: v for k, v in timing.items() if k != "backends"},
        "backends": rows, "done_when": done_when(manifest, predictor, rows, artifact, sha, trunks),
        "llama_cpp": {"skipped": "--no-llama-cpp"} if args.no_llama_cpp else
        llama_cpp_reference(predictor, timed, rows["torch"]["speed"]["latency_p50_s"]),
    }
    write_result(args.output, result)
    return 0


def llama_cpp_reference(predictor, questions, torch_p50: float) -> dict:
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
    ids = [tokenize(p) for p in prompts]
    llm.reset()
    llm.eval(ids[0])  # warm-up
    times = []
    for seq in ids:
        llm.reset()
        start = time.perf_counter()
        llm.eval(seq)
        times.append(time.perf_counter() - start)
    p50 = float(np.percentile(times, 50))
    return {"binding": f"llama-cpp-python {__version__}", "gguf": gguf.name, "threads": threads,
            "mean_prompt_tokens": float(np.mean([len(s) for s in ids])),
            "prompt_latency_p50_s": p50, "prompt_latency_p99_s": float(np.percentile(times, 99)),
            "prompt_tokens_per_s": float(sum(len(s) for s in ids) / sum(times)),
            "p50_speedup_vs_torch": torch_p50 / p50,
            "note": "batch 1, measured after the backends, not interleaved; Q4_1 weights in llama.cpp's kernels; "
                    "the full LM head runs for the last token"}


if __name__ == "__main__":
    sys.exit(main())
