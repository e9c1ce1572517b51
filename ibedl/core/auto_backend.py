"""``IBEDL_BACKEND=auto``: the backend this machine runs an artifact fastest on, by measurement.

A CPU's flags do not say which precision is fastest: on one AVX512-BF16 CPU bfloat16 served 2.42x torch fp32, on
another 0.76x (its bf16 matmul peak is half its fp32 one; benchmarks/results/cpu_backends.json). So ``auto`` times
the trunk of every candidate (the registered backends that declare ``auto``: :func:`candidate_names`) this machine
runs and the artifact carries a calibration for, each against the fastest so far on batches of
:data:`TIMING_QUESTIONS` prompts of a served length, the two alternated over :data:`TIMING_ROUNDS` rounds (median: a
burst of other work slows both of a round alike), and keeps the faster (:func:`tournament`). The measurement is
cached under ``IBEDL_CACHE_DIR/backends/auto-<key>.json``, keyed by the CPU, thread count, library versions, adapter
and candidates (and on CUDA the GPU).

On CUDA the candidates are torch's arithmetics there (ibedl.core.backends.torch_cuda: fp32, bf16, NF4 weights with
bf16 compute) against torch as loaded; one in the arithmetic torch was loaded in is not timed twice.

Loading never builds: :func:`start_choice` serves the cached measurement's winner when its IR is cached, else torch,
and says which candidates are still to build and time. The service does that in the background
(ibedl.engine.backend_switch) and switches when a faster one is proven; elsewhere
``python -m ibedl.core.measure_backends --artifact DIR`` builds and times them (minutes, once per machine), and
``--build NAME`` exports one backend's IR into the cache (what the service's background builder runs, niced).
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from ibedl.core import arithmetic, backends, quantization_sample
from ibedl.core.backends import registry
from ibedl.core.backends.registry import REFERENCE
from ibedl.core.base_model import cache_dir, sha256_file
from ibedl.core.cpu_isa import cpu_signature
from ibedl.core.memory_limit import collect_garbage
from ibedl.core.prompt import MCQuestion

log = logging.getLogger(__name__)

TIMING_QUESTIONS = 8  # the batch the bar and the service's batcher use
TIMING_ROUNDS = 5  # rounds of a timed call of each of a pair, alternated (A B A B ...) after a warm-up; medians count
CHOICE_FORMAT = 2  # bump when what is timed changes (2: interleaved medians of pairs)
BUILD_ERRORS = (ImportError, OSError, RuntimeError, ValueError)  # a candidate that raises these is skipped
# A SciQ-like prompt: a passage of about 250 tokens and four options (SciQ test prompts: 150-450 tokens).
_PASSAGE = ("Mitochondria are the organelles where cellular respiration releases the energy stored in glucose. "
            "The energy is captured in molecules of ATP, which the cell spends on movement and synthesis. ") * 6


@dataclass
class AutoChoice:
    """What ``auto`` measured and chose.

    Attributes:
        backend: the chosen backend.
        reason: one line on why (logged, and served in ``GET /v1/models``).
        seconds: candidate -> seconds per batch of :data:`TIMING_QUESTIONS` prompts (the fastest of the repeats).
        skipped: candidate -> why it was not timed.
        measured: when the timings were taken (ISO 8601, UTC).
        cached: the timings were read from an earlier start's measurement (``path``) instead of taken now.
        path: the cache file of this measurement.
        pending: candidates not measured yet (their IR not built, or no measurement cached): to build and time
            (the service does it in the background; ``python -m ibedl.core.measure_backends --artifact DIR``).
        base_sha256: the base model's sha256 the cache key and IR were made with.
    """

    backend: str
    reason: str
    seconds: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    measured: str | None = None
    cached: bool = False
    path: str | None = None
    pending: list[str] = field(default_factory=list)
    base_sha256: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def candidate_names() -> list[str]:
    """Every registered backend ``auto`` may choose (``Backend.auto``), the costliest build first and so the
    reference, torch (nothing to build), last (``Backend.build_cost``; ties in registry order): the order
    :func:`choose` times them in and a cached measurement is keyed by (a new order makes every machine measure
    again)."""
    chosen = [b for b in registry.REGISTRY.values() if b.auto]
    return [b.name for b in sorted(chosen, key=lambda b: -b.build_cost)]


def build_order(names: list[str]) -> list[str]:
    """``names`` but the reference, in the order the background builds them: the cheapest first
    (``Backend.build_cost``), so a faster backend is served as soon as one is proven, not after the slowest build."""
    return sorted((n for n in names if n != REFERENCE), key=lambda n: registry.get(n).build_cost)


def candidates(predictor, artifact: Path, unavailable) -> tuple[list[str], dict[str, str]]:
    """(candidates to time, candidate -> why not) for ``predictor`` (on torch) loaded from ``artifact``: those whose
    calibration the manifest carries (for a static int8 backend: one made on the artifact's quantisation sample and
    this CPU's int8 class), that compute in other arithmetic than torch as loaded, and that this machine runs:
    ``unavailable(name, predictor, artifact)`` says why it cannot, or None (ibedl.core.backends.unavailable)."""
    carried = predictor.manifest.calibration_keys() if predictor.manifest is not None else []
    loaded = predictor.calibration_key_on(REFERENCE)
    chosen, skipped = [], {}
    sample = quantization_sample.sha256(artifact)  # once: every candidate whose arithmetic depends on the CPU reads it
    for name in candidate_names():
        key, backend = predictor.calibration_key_on(name), registry.get(name)
        if key not in carried:
            skipped[name] = f"the artifact carries no calibration made on it ({key})"
        elif name != REFERENCE and key == loaded:  # e.g. torch-cuda-bf16 beside a model loaded in bf16 on CUDA
            skipped[name] = f"{REFERENCE} as loaded computes in its arithmetic ({key})"
        elif why := (arithmetic.depends(backend) and arithmetic.mismatch(
                backend, predictor.manifest.calibration_for(key).record, sample)) \
                or unavailable(name, predictor, artifact):
            skipped[name] = why
        else:
            chosen.append(name)
    return chosen, skipped


def timing_questions(n: int = TIMING_QUESTIONS) -> list[MCQuestion]:
    """``n`` prompts of a served length (each with a passage and four options)."""
    return [MCQuestion(f"Question {i}: what do mitochondria release?", ("energy", "water", "light", "sound"),
                       context=_PASSAGE) for i in range(n)]


def time_call(run) -> float:
    """Seconds one call of ``run()`` takes."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def interleaved_seconds(runs: dict, rounds: int = TIMING_ROUNDS, timer=None) -> dict[str, float]:
    """name -> median seconds of ``runs[name]()``: one warm-up call of each, then ``rounds`` rounds of one timed call
    of each in turn (A B C A B C ...), so a slow spell of the machine falls on all of them rather than on one.
    ``timer(run) -> seconds`` times one call (default :func:`time_call`; the service runs it between passes)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    timer = timer or time_call
    for run in runs.values():
        timer(run)  # first-call costs (allocation, kernel selection) are not the backend's speed
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(timer(run))
    return {name: statistics.median(t) for name, t in times.items()}


def tournament(names: list[str], build, run_of, champion: tuple[str, object], timer=None,
               rounds: int = TIMING_ROUNDS, on_win=None) -> tuple[str, object, dict[str, float], dict[str, str]]:
    """Each of ``names`` in turn against the fastest so far, first ``champion`` ((name, trunk) of the backend
    serving now), timed interleaved (:func:`interleaved_seconds`); one faster than it takes its place
    (``on_win(name, trunk)``: the service switches to it then). ``build(name)`` returns a trunk (None: torch),
    ``run_of(trunk)`` a call answering one timing batch on it. Holds two trunks at once besides torch's model.
    Returns (the fastest's name, its trunk, name -> median seconds per batch, name -> why it was not timed)."""
    best, best_trunk = champion
    seconds: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for name in names:
        if name == best:
            continue
        try:
            trunk = build(name)
        except BUILD_ERRORS as e:  # e.g. no room to export, a compile that crashes: not a candidate
            skipped[name] = f"could not be built: {type(e).__name__}: {e}"
            log.warning("auto: %s %s", name, skipped[name])
            continue
        pair = interleaved_seconds({best: run_of(best_trunk), name: run_of(trunk)}, rounds, timer)
        seconds.update(pair)
        log.info("auto: %s %.3f s, %s %.3f s per batch of %d prompts (medians of %d interleaved rounds)", best,
                 pair[best], name, pair[name], TIMING_QUESTIONS, rounds)
        if pair[name] < pair[best]:
            best, best_trunk = name, trunk
            if on_win is not None:
                on_win(name, trunk)
        del trunk  # the loser's compiled model goes: memory stays two trunks'
        collect_garbage()
    return best, best_trunk, seconds, skipped


def choice_path(predictor, artifact: Path, base_sha256: str, names: list[str]) -> Path:
    """The cache file of a measurement of ``names`` for this adapter on this machine (on CUDA: and its GPU)."""
    try:
        import openvino
    except ImportError:  # a GPU machine may go without: its candidates are torch's
        openvino = None

    digest = hashlib.sha256()
    member = predictor.manifest.members[0] if predictor.manifest else "."
    for part in (str(CHOICE_FORMAT), cpu_signature(), str(torch.get_num_threads()), torch.__version__,
                 openvino.__version__ if openvino else "", base_sha256,
                 sha256_file(Path(artifact) / member / "adapter_model.safetensors"),
                 quantization_sample.sha256(artifact) or "", ",".join(names), *gpu_signature(predictor.device)):
        digest.update(part.encode() + b"\0")
    return cache_dir() / "backends" / f"auto-{digest.hexdigest()[:16]}.json"


def gpu_signature(device) -> tuple[str, ...]:
    """What a measurement on ``device`` depends on besides the CPU: the GPU's name and the CUDA torch was built with
    (nothing on the CPU, so a CPU's cached measurements keep their key)."""
    device = torch.device(device)
    if device.type != "cuda":
        return ()
    return torch.cuda.get_device_name(device), str(torch.version.cuda)


def start_choice(predictor, artifact: Path, base_sha256: str, build_cached, unavailable) -> tuple[AutoChoice, object]:
    """(the choice, its trunk: None for torch) without building anything: the winner of the cached measurement of
    this machine when ``build_cached(name)`` compiles it from its cached IR, else torch. ``pending``: the candidates
    still to build and time (none when the cached measurement covers them all). ``build_cached`` raises (one of
    :data:`BUILD_ERRORS`) where the IR is not cached."""
    names, skipped = candidates(predictor, artifact, unavailable)
    if names == [REFERENCE] or not names:
        why = "; ".join(f"{k}: {v}" for k, v in skipped.items() if k != REFERENCE)
        return AutoChoice(REFERENCE, f"the fallback: {why}", skipped=skipped, base_sha256=base_sha256), None
    path = choice_path(predictor, artifact, base_sha256, names)
    stored = _read(path, names)
    if stored is not None:
        name = min(stored["seconds"], key=stored["seconds"].get)
        try:
            trunk = build_cached(name)
        except BUILD_ERRORS as e:  # e.g. its cached IR was removed: serve torch, build and measure again
            log.warning("auto: %s, chosen at an earlier start, is not ready here (%s: %s); measuring again", name,
                        type(e).__name__, e)
        else:
            return AutoChoice(name, _reason(name, stored["seconds"], cached=True), stored["seconds"], skipped,
                              stored["measured"], True, str(path), [], base_sha256), trunk
    pending = build_order(names)
    reason = (f"not measured on this machine yet: {REFERENCE}, which needs no build, until {', '.join(pending)} are "
              f"built and timed ({HOW_TO_MEASURE})")
    return AutoChoice(REFERENCE, reason, skipped=skipped, path=str(path), pending=pending,
                      base_sha256=base_sha256), None


HOW_TO_MEASURE = ("the service does it in the background and switches to a faster one once proven; elsewhere: "
                  "python -m ibedl.core.measure_backends --artifact DIR, minutes once per machine")


def choose(predictor, artifact: Path, base_sha256: str, build, unavailable, timer=None) -> tuple[AutoChoice, object]:
    """(the choice, the chosen backend's trunk: None for torch), measured now: ``build(name)`` returns the trunk of
    backend ``name`` (None for torch), building what is not cached (minutes); ``unavailable``: see
    :func:`candidates`. Every candidate is timed against the fastest so far (:func:`tournament`) and the measurement
    cached for :func:`start_choice`; torch when nothing else can run."""
    names, skipped = candidates(predictor, artifact, unavailable)
    if names == [REFERENCE] or not names:
        why = "; ".join(f"{k}: {v}" for k, v in skipped.items() if k != REFERENCE)
        return AutoChoice(REFERENCE, f"the fallback: {why}", skipped=skipped, base_sha256=base_sha256), None
    batch = predictor.encode(timing_questions())
    best, trunk, seconds, failed = tournament([n for n in names if n != REFERENCE], build, runner(predictor, batch),
                                              (REFERENCE, None), timer)
    return record(predictor, artifact, base_sha256, names, seconds, {**skipped, **failed}, best), trunk


def record(predictor, artifact: Path, base_sha256: str, names: list[str], seconds: dict[str, float],
           skipped: dict[str, str], best: str) -> AutoChoice:
    """The choice of ``best`` after ``seconds`` were measured, cached when every candidate of ``names`` was timed (a
    measurement with a candidate missing is not the one to read back)."""
    path = choice_path(predictor, artifact, base_sha256, names)
    measured = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if seconds and set(seconds) == set(names):
        _write(path, {"format": CHOICE_FORMAT, "candidates": names, "seconds": seconds, "measured": measured,
                      "cpu": cpu_signature(), "threads": torch.get_num_threads()})
    if not seconds:
        why = "; ".join(f"{k}: {v}" for k, v in skipped.items())
        return AutoChoice(REFERENCE, f"the fallback: {why}", skipped=skipped, measured=measured, path=str(path),
                          base_sha256=base_sha256)
    return AutoChoice(best, _reason(best, seconds, cached=False), seconds, skipped, measured, False, str(path), [],
                      base_sha256)


def runner(predictor, batch):
    """``run_of(trunk)`` for :func:`tournament`: a call answering ``batch`` on ``trunk`` (None: the predictor's
    torch model, without touching what the predictor serves with)."""
    def run_of(trunk):
        if trunk is None:
            return lambda: finished(torch_hidden(predictor, batch))
        return lambda: finished(trunk(batch))
    return run_of


def finished(hidden):
    """``hidden`` once it is computed: a CUDA call returns when its kernels are queued, so a timer would otherwise
    time the queueing (CPU results are returned computed)."""
    if isinstance(hidden, torch.Tensor) and hidden.is_cuda:
        torch.cuda.synchronize(hidden.device)
    return hidden


def torch_hidden(predictor, batch) -> torch.Tensor:
    """The (B, d) last-token hidden states of ``batch`` on the predictor's torch model, whatever its trunk, on the
    model's device."""
    batch = batch.to(predictor.device)
    with torch.no_grad():
        out = predictor.decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    states = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return states[torch.arange(states.shape[0], device=states.device), batch.last_index]


def age_s(choice: AutoChoice, now: datetime | None = None) -> float | None:
    """Seconds since ``choice`` was measured (None: never)."""
    if choice.measured is None:
        return None
    now = now or datetime.now(timezone.utc)
    return (now - datetime.fromisoformat(choice.measured)).total_seconds()


def _reason(name: str, seconds: dict[str, float], cached: bool) -> str:
    ratio = seconds[REFERENCE] / seconds[name] if REFERENCE in seconds else None
    times = ", ".join(f"{k} {v:.3f} s" for k, v in sorted(seconds.items(), key=lambda kv: kv[1]))
    vs = f", {ratio:.2f}x {REFERENCE}" if ratio is not None else ""
    when = "measured at an earlier start" if cached else "measured"
    return (f"the fastest calibrated backend on this machine ({when} on batches of {TIMING_QUESTIONS} prompts, "
            f"medians of interleaved rounds: {times}{vs})")


def _read(path: Path, names: list[str]) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = (isinstance(data, dict) and data.get("format") == CHOICE_FORMAT and data.get("candidates") == names
          and isinstance(data.get("seconds"), dict) and set(data["seconds"]) == set(names)
          and all(isinstance(v, (int, float)) and v > 0 for v in data["seconds"].values()))
    return data if ok else None


def _write(path: Path, data: dict) -> None:
    """Cache a measurement; where the cache cannot be written (a read-only filesystem) each start measures again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)
    except OSError as e:
        log.warning("auto: could not cache the measurement in %s (%s): each start measures again", path, e)


def build(backend: str, predictor, artifact: Path, base_sha256: str) -> backends.Built:
    """What ``predictor`` serves on (:meth:`ibedl.core.predictor.Predictor.serve_on` applies it): a named backend
    built (ibedl.core.backends.build_trunk); ``auto`` builds nothing (:func:`start_choice`: the cached measurement's
    winner, else torch; what it weighed and what is still to build and time in ``Built.choice``), and logs what it
    chose and why."""
    if registry.check_backend(backend) != "auto":
        return backends.build_trunk(backend, predictor, artifact, base_sha256)
    artifact = Path(artifact)
    choice, trunk = start_choice(
        predictor, artifact, base_sha256,
        lambda name: backends.build_one(name, predictor, artifact, base_sha256, export=False), backends.unavailable)
    log.info("inference backend auto -> %s (%s)%s", choice.backend, choice.reason,
             f"; measured again once {choice.path} is deleted" if choice.path and choice.cached else "")
    if choice.pending:
        log.warning("inference backend auto: %s not measured on this machine yet; serving %s meanwhile (%s)",
                    ", ".join(choice.pending), choice.backend, HOW_TO_MEASURE)
    return backends.Built(trunk, choice.backend, choice.reason, choice,
                          registry.get(choice.backend).quantized_on(artifact))


__all__ = ["build", "candidate_names", "build_order", "TIMING_QUESTIONS", "TIMING_ROUNDS", "AutoChoice", "candidates",
           "start_choice", "choose", "tournament", "interleaved_seconds", "record", "runner", "timing_questions",
           "choice_path", "age_s"]
