"""``IBEDL_BACKEND=auto``: the backend this machine runs an artifact fastest on, measured at start-up.

A CPU's flags do not say which precision is fastest: on one AVX512-BF16 CPU bfloat16 served 2.42x torch fp32, on
another 0.76x (its bf16 matmul peak is half its fp32 one; benchmarks/results/cpu_backends.json). So ``auto`` times
the trunk of every candidate (:data:`CANDIDATES`) this machine runs and the artifact carries a calibration for, on
one batch of :data:`TIMING_QUESTIONS` prompts of a served length, and keeps the fastest. The measurement is cached
under ``IBEDL_CACHE_DIR/backends/auto-<key>.json``, keyed by the CPU, thread count, library versions, adapter and
candidates, so later starts read it; delete the file to measure again.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import platform
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from ibedl.core import quantization_sample
from ibedl.core.base_model import cache_dir, sha256_file
from ibedl.core.prompt import MCQuestion

log = logging.getLogger(__name__)

# Every backend auto may pick; torch, the reference, is always timed beside the OpenVINO ones it can run.
CANDIDATES = ("openvino-int8", "openvino-bf16", "openvino-fp32", "torch")
TIMING_QUESTIONS = 8  # the batch the bar and the service's batcher use
TIMING_REPEATS = 3  # timed calls per candidate after one warm-up; the fastest counts (the least disturbed)
CHOICE_FORMAT = 1  # bump when what is timed changes
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
    """

    backend: str
    reason: str
    seconds: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    measured: str | None = None
    cached: bool = False
    path: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def candidates(predictor, artifact: Path, unavailable) -> tuple[list[str], dict[str, str]]:
    """(candidates to time, candidate -> why not) for ``predictor`` (on torch) loaded from ``artifact``: those whose
    calibration the manifest carries (for static int8: one made on the artifact's quantisation sample) and this
    machine runs: ``unavailable(name, predictor, artifact)`` says why it cannot, or None
    (ibedl.core.backends.unavailable)."""
    carried = predictor.manifest.calibration_keys() if predictor.manifest is not None else []
    chosen, skipped = [], {}
    for name in CANDIDATES:
        key = predictor.calibration_key if name == "torch" else name
        if key not in carried:
            skipped[name] = f"the artifact carries no calibration made on it ({key})"
        elif name == "openvino-int8" and (why := quantization_sample.mismatch(
                predictor.manifest.calibration_for(key).record, quantization_sample.sha256(artifact))):
            skipped[name] = why
        elif why := unavailable(name, predictor, artifact):
            skipped[name] = why
        else:
            chosen.append(name)
    return chosen, skipped


def timing_questions(n: int = TIMING_QUESTIONS) -> list[MCQuestion]:
    """``n`` prompts of a served length (each with a passage and four options)."""
    return [MCQuestion(f"Question {i}: what do mitochondria release?", ("energy", "water", "light", "sound"),
                       context=_PASSAGE) for i in range(n)]


def seconds_per_batch(run, repeats: int = TIMING_REPEATS) -> float:
    """The fastest of ``repeats`` timed calls of ``run()`` after one warm-up call."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def cpu_signature() -> str:
    """The CPU's model name and flags (Linux), else what ``platform`` knows, and oneDNN's instruction cap when one
    is set (ibedl.core.cpu_isa.onednn_cap: the kernels, so the timings, are another CPU's)."""
    from ibedl.core.cpu_isa import onednn_cap

    cap = [f"ONEDNN_MAX_CPU_ISA={onednn_cap()}"] if onednn_cap() else []
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return " | ".join([f"{platform.machine()} {platform.processor()}", *cap])
    lines = [line.split(":", 1)[1].strip() for line in info.splitlines()
             if line.startswith(("model name", "flags")) and ":" in line]
    return " | ".join([*dict.fromkeys(lines), *cap])


def choice_path(predictor, artifact: Path, base_sha256: str, names: list[str]) -> Path:
    """The cache file of a measurement of ``names`` for this adapter on this machine."""
    import openvino

    digest = hashlib.sha256()
    member = predictor.manifest.members[0] if predictor.manifest else "."
    for part in (str(CHOICE_FORMAT), cpu_signature(), str(torch.get_num_threads()), torch.__version__,
                 openvino.__version__, base_sha256, sha256_file(Path(artifact) / member / "adapter_model.safetensors"),
                 quantization_sample.sha256(artifact) or "", ",".join(names)):
        digest.update(part.encode() + b"\0")
    return cache_dir() / "backends" / f"auto-{digest.hexdigest()[:16]}.json"


def choose(predictor, artifact: Path, base_sha256: str, build, unavailable,
           fresh: bool = False) -> tuple[AutoChoice, object]:
    """(the choice, the chosen backend's trunk: None for torch). ``build(name)`` returns the trunk of backend
    ``name`` (None for torch); ``unavailable``: see :func:`candidates`. Times each candidate unless an earlier start
    on this machine measured the same ones (the cache file; ``fresh``: measure anyway), and keeps the fastest;
    torch when nothing else can run."""
    names, skipped = candidates(predictor, artifact, unavailable)
    if names == ["torch"] or not names:
        why = "; ".join(f"{k}: {v}" for k, v in skipped.items() if k != "torch")
        return AutoChoice("torch", f"the fallback: {why}", skipped=skipped), None
    path = choice_path(predictor, artifact, base_sha256, names)
    stored = None if fresh else _read(path, names)
    if stored is not None:
        name = min(stored["seconds"], key=stored["seconds"].get)
        choice = AutoChoice(name, _reason(name, stored["seconds"], cached=True), stored["seconds"], skipped,
                            stored["measured"], True, str(path))
        try:
            return choice, build(name)
        except BUILD_ERRORS as e:  # e.g. its cached IR was removed and cannot be exported here: measure again
            log.warning("auto: %s, chosen at an earlier start, could not be built (%s: %s); measuring again", name,
                        type(e).__name__, e)
    batch = predictor.encode(timing_questions())
    seconds = {}
    for name in names:
        try:
            trunk = build(name)
        except BUILD_ERRORS as e:  # e.g. no room to export: not a candidate
            skipped[name] = f"could not be built: {type(e).__name__}: {e}"
            log.warning("auto: %s %s", name, skipped[name])
            continue
        run = (lambda t=trunk: t(batch)) if trunk is not None else (lambda: _torch_hidden(predictor, batch))
        seconds[name] = seconds_per_batch(run)
        log.info("auto: %s answers a batch of %d prompts in %.3f s", name, TIMING_QUESTIONS, seconds[name])
        del trunk, run  # one compiled model at a time beside torch's: the start's memory peak stays one model's
        gc.collect()
    if not seconds:
        why = "; ".join(f"{k}: {v}" for k, v in skipped.items())
        return AutoChoice("torch", f"the fallback: {why}", skipped=skipped), None
    best = min(seconds, key=seconds.get)
    measured = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if set(seconds) == set(names):  # a measurement with a candidate missing is not the one to read back
        _write(path, {"format": CHOICE_FORMAT, "candidates": names, "seconds": seconds, "measured": measured,
                      "cpu": cpu_signature(), "threads": torch.get_num_threads()})
    choice = AutoChoice(best, _reason(best, seconds, cached=False), seconds, skipped, measured, False, str(path))
    return choice, build(best)  # compiled again from the cached IR: seconds


def _torch_hidden(predictor, batch) -> torch.Tensor:
    trunk, predictor.trunk = predictor.trunk, None
    try:
        with torch.no_grad():
            return predictor.hidden(batch)
    finally:
        predictor.trunk = trunk


def _reason(name: str, seconds: dict[str, float], cached: bool) -> str:
    ratio = seconds["torch"] / seconds[name] if "torch" in seconds else None
    times = ", ".join(f"{k} {v:.3f} s" for k, v in sorted(seconds.items(), key=lambda kv: kv[1]))
    vs = f", {ratio:.2f}x torch" if ratio is not None else ""
    when = "measured at an earlier start" if cached else "measured"
    return (f"the fastest calibrated backend on this machine ({when} on a batch of {TIMING_QUESTIONS} prompts: "
            f"{times}{vs})")


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


__all__ = ["CANDIDATES", "TIMING_QUESTIONS", "AutoChoice", "candidates", "choose", "seconds_per_batch",
           "timing_questions", "choice_path"]
