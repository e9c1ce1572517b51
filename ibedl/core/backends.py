"""Inference backends for the trunk: the part of :class:`~ibedl.core.predictor.Predictor` that turns an encoded
batch into the (B, d) hidden state of each prompt's last real token. The option head, Dirichlet outputs and
abstention stay the predictor's own code whatever the backend.

``auto`` (the default): the backend this machine runs the artifact fastest on, measured among those the artifact
carries a calibration for (ibedl.core.auto_backend; loading builds nothing: the cached measurement's winner, else
torch, until the others are built and timed); ``torch`` when no other can run (CUDA,
MC-Dropout, ensembles, no openvino, no calibration made on OpenVINO). ``torch``: the PEFT model as loaded (fp32
eager on CPU). ``openvino-fp32``: the LoRA-merged trunk converted once to OpenVINO IR. ``openvino-bf16``: that fp32
IR run with bfloat16 matmuls (fp32 accumulation) on CPUs with native bf16 instructions (AVX512-BF16, AMX).
``openvino``: the IR with int8 weights (asymmetric, one scale per 64 input channels), decompressed inside the CPU
plugin's matmul kernels; activations stay fp32. ``openvino-int8``: static int8 (weights and activations) by NNCF
post-training quantisation on the artifact's quantisation sample (ibedl.core.quantization_sample). IR are cached
under ``IBEDL_CACHE_DIR/backends``, keyed by base model, adapter, backend and (static int8) the quantisation sample.

A guarantee is a property of the weights and of the arithmetic that runs them: thresholds and conformal quantiles
are calibrated per backend and precision (:func:`calibration_key`), and the service serves the calibration that
matches its backend (ibedl.core.artifact.Manifest.calibration_for).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ibedl.core.base_model import MARKER, cache_dir, sha256_file
from ibedl.core.memory_limit import expendable, killed_reason

log = logging.getLogger(__name__)

BACKENDS = ("torch", "openvino", "openvino-fp32", "openvino-bf16", "openvino-int8", "auto")
# Which backend is fastest depends on the CPU, not only on its flags (benchmarks/results/cpu_backends.json): ``auto``
# measures it at start-up (ibedl.core.auto_backend).
DEFAULT_BACKEND = "auto"
CACHE_FORMAT = 1  # bump when the exported graph or its compression changes
QUANTIZATION_MAX_TOKENS = 1 << 20  # quantisation sample prompts are read whole (no context cut at a token limit)
# Measured on 30 SciQ validation questions (max |p - p_torch|): int8 per output channel (nncf's INT8 modes)
# 0.026-0.04; per 64 input channels 0.003. The plugin's dynamic int8 activations (groups of 16 / 64) added
# 0.017 / 0.034, so they are off (DYNAMIC_QUANTIZATION_GROUP_SIZE 0).
GROUP_SIZE = 64
# The IR each OpenVINO backend runs and the precision its matmuls compute in. bf16 keeps the fp32 IR (exported
# once for both) and lets the CPU plugin run matmuls in bfloat16; on 96 SciQ validation questions it served 2.6x
# torch's batch-8 throughput with torch's answers and max |p - p_torch| 0.030. The plugin's per-node "keep fp32"
# marks did not change that error here.
IR_OF = {"openvino": "openvino", "openvino-fp32": "openvino-fp32", "openvino-bf16": "openvino-fp32",
         "openvino-int8": "openvino-int8"}
PRECISION_OF = {"openvino": "f32", "openvino-fp32": "f32", "openvino-bf16": "bf16", "openvino-int8": "f32"}
_SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def check_backend(name: str) -> str:
    """``name`` if it is a known backend, else a ValueError naming it and the choices."""
    if name not in BACKENDS:
        raise ValueError(f"unknown inference backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return name


def calibration_key(backend: str, device="cpu", dtype="float32", load_in_4bit: bool = False) -> str:
    """The name of the arithmetic a calibration was made on (the manifest's ``calibrated_on`` and the keys of its
    ``backend_calibrations``): an OpenVINO backend's own name (its precision is in it), ``torch-<precision>`` for
    torch on the CPU, ``torch-cuda-[nf4-]<precision>`` on CUDA. ``dtype``: a torch dtype or its name."""
    if check_backend(backend) == "auto":
        raise ValueError("calibration_key needs a concrete backend; resolve auto first (build_trunk)")
    if backend != "torch":
        return backend
    name = str(dtype).removeprefix("torch.")
    if name not in _SHORT_DTYPES:
        raise ValueError(f"no calibration key for dtype {dtype!r}; expected one of {sorted(_SHORT_DTYPES)}")
    on_cuda = str(device).startswith("cuda")
    return "-".join(["torch", *(["cuda"] if on_cuda else []), *(["nf4"] if load_in_4bit else []), _SHORT_DTYPES[name]])


class LastTokenTrunk(torch.nn.Module):
    """Decoder trunk + gather: (input_ids, attention_mask, last_index) -> (B, d) last-token hidden state."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
        states = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return states[torch.arange(states.shape[0]), last_index]


def adapter_key(artifact: Path, member: str, base_sha256: str, backend: str) -> str:
    """Cache key of an exported trunk: base weights, adapter weights and config, backend, export format."""
    import openvino

    digest = hashlib.sha256()
    for part in (base_sha256, backend, str(CACHE_FORMAT), openvino.__version__):
        digest.update(part.encode() + b"\0")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        digest.update(sha256_file(artifact / member / name).encode())
    return digest.hexdigest()


def compress_int8_groups(ir, group: int) -> int:
    """Replace each fp32 linear weight of an OpenVINO model by u8 values with a scale and zero point per group of
    ``group`` input channels, in the decompression pattern the CPU plugin fuses into int8 matmuls. Returns how
    many weights were replaced (those whose input size ``group`` does not divide stay fp32)."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    replaced = 0
    for node in ir.get_ordered_ops():
        if node.get_type_name() != "MatMul" or not node.get_attributes().get("transpose_b"):
            continue
        source = node.input_value(1).get_node()
        if source.get_type_name() != "Constant" or source.get_element_type() != ov.Type.f32:
            continue
        weight = source.get_data()  # (out, in)
        if weight.ndim != 2 or weight.shape[1] % group:
            continue
        w = weight.reshape(weight.shape[0], -1, group)  # (out, in / group, group)
        lo, hi = w.min(-1, keepdims=True), w.max(-1, keepdims=True)
        scale = np.maximum(hi - lo, 1e-8) / 255.0
        zero = np.clip(np.round(-lo / scale), 0, 255)
        q = np.clip(np.round(w / scale) + zero, 0, 255).astype(np.uint8)
        deq = ops.multiply(
            ops.subtract(ops.convert(ops.constant(q), ov.Type.f32),
                         ops.convert(ops.constant(zero.astype(np.uint8)), ov.Type.f32)),
            ops.constant(scale.astype(np.float32)),
        )
        node.input(1).replace_source_output(
            ops.reshape(deq, ops.constant(np.array(weight.shape, np.int64)), False).output(0))
        replaced += 1
    return replaced


def quantize_static(ir, sample: list):
    """Static int8 (weights and activations) of an fp32 IR by NNCF post-training quantisation, its activation
    ranges measured on ``sample`` (encoded batches: :class:`~ibedl.core.predictor.EncodedBatch`). NNCF's
    transformer preset keeps the layers that quantise badly (softmax, norms) in floating point."""
    try:
        import nncf
    except ImportError as e:
        raise ImportError("backend 'openvino-int8' quantises with NNCF: pip install -e '.[serve]'") from e
    if not sample:
        raise ValueError("static int8 needs a calibration sample of at least one encoded batch")
    data = nncf.Dataset(sample, lambda b: {"input_ids": b.input_ids.numpy(), "attention_mask": b.attention_mask.numpy(),
                                           "last_index": b.last_index.numpy()})
    return nncf.quantize(ir, data, model_type=nncf.ModelType.TRANSFORMER, subset_size=len(sample))


def _export(model, tokenizer, target: Path, compress: bool, sample: list | None = None,
            copy_model: bool = True) -> None:
    """LoRA-merged trunk -> OpenVINO IR in ``target`` (written to a temporary directory, then renamed); int8
    weights with ``compress``, static int8 quantised on ``sample`` (encoded batches) when one is given; the LoRA is
    merged into a copy of ``model`` unless ``copy_model`` is False (then into ``model`` itself)."""
    import openvino as ov

    from ibedl.core.base_model import decoder_of

    start = time.perf_counter()
    merged = copy.deepcopy(model) if copy_model else model
    merged = merged.merge_and_unload() if hasattr(merged, "merge_and_unload") else merged
    trunk = LastTokenTrunk(decoder_of(merged)).eval()
    ids = tokenizer("a b c d e f g h")["input_ids"]
    example = (torch.tensor([ids, ids]), torch.ones(2, len(ids), dtype=torch.long), torch.tensor([len(ids) - 1] * 2))
    with torch.no_grad():
        ir = ov.convert_model(
            trunk,
            example_input=example,
            input=[("input_ids", [-1, -1], ov.Type.i64), ("attention_mask", [-1, -1], ov.Type.i64),
                   ("last_index", [-1], ov.Type.i64)],
        )
    if compress:
        compress_int8_groups(ir, GROUP_SIZE)
    record = {"compress": compress}
    if sample is not None:
        ir = quantize_static(ir, sample)
        record["static_int8"] = {"sample_batches": len(sample), "sample_sha256": sample_digest(sample)}
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    ov.save_model(ir, tmp / "trunk.xml", compress_to_fp16=False)
    (tmp / MARKER).write_text(json.dumps({**record, "seconds": round(time.perf_counter() - start, 1)}))
    if target.exists():
        shutil.rmtree(target)
    tmp.replace(target)


@dataclass
class OpenVINOTrunk:
    """A compiled OpenVINO trunk; ``trunk(batch)`` -> (B, d) float32 hidden states on the CPU."""

    compiled: object
    path: Path

    def __call__(self, batch) -> torch.Tensor:
        out = self.compiled([batch.input_ids.numpy(), batch.attention_mask.numpy(), batch.last_index.numpy()])
        return torch.from_numpy(out[0].copy())


def native_bf16() -> bool:
    """Whether OpenVINO's CPU plugin runs bfloat16 natively here (what ``openvino-bf16`` needs)."""
    import openvino as ov

    from ibedl.core.cpu_isa import capped_without_bf16

    return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES") and not capped_without_bf16()


def sample_digest(sample: list) -> str:
    """sha256 over the token ids of a quantisation sample (encoded batches): what a static int8 IR depends on besides
    the weights (recorded in its cache marker and part of its cache key)."""
    digest = hashlib.sha256()
    for b in sample:
        digest.update(b.input_ids.numpy().tobytes())
    return digest.hexdigest()


def ir_path(artifact: Path, member: str, base_sha256: str, backend: str, sample: list | None = None) -> Path:
    """Where the IR of ``backend`` for this adapter is cached; static int8's also by its quantisation sample
    (ValueError without one: which quantisation would it be?)."""
    ir = IR_OF[backend]
    key = adapter_key(artifact, member, base_sha256, ir)
    if ir == "openvino-int8":
        if not sample:
            raise ValueError("backend 'openvino-int8' quantises the trunk on the artifact's quantisation sample "
                             "(quantization_sample.jsonl), and it carries none: add one with python -m "
                             "ibedl.training.calibrate --artifact DIR --dataset NAME --backend openvino-int8")
        key = hashlib.sha256(f"{key}\0{sample_digest(sample)}".encode()).hexdigest()
    return cache_dir() / "backends" / f"{ir}-{key[:16]}"


def openvino_trunk(model, tokenizer, artifact: Path, member: str, base_sha256: str, backend: str,
                   threads: int | None = None, sample: list | None = None, export: bool = True) -> OpenVINOTrunk:
    """Compile the cached IR of this adapter, exporting it once if missing (``export``; else FileNotFoundError).
    ``sample``: the encoded batches ``openvino-int8`` is quantised on (once per adapter and sample; the cached IR is
    used after)."""
    try:
        import openvino as ov
    except ImportError as e:
        raise ImportError(f"backend {backend!r} needs openvino: pip install -e '.[serve]'") from e
    core = ov.Core()
    precision = PRECISION_OF[backend]
    if precision == "bf16" and not native_bf16():
        raise ValueError(f"backend {backend!r} needs a CPU with native bfloat16 (AVX512-BF16 or AMX); this one has "
                         f"{', '.join(core.get_property('CPU', 'OPTIMIZATION_CAPABILITIES'))}: use openvino-fp32")
    target = ensure_ir(model, tokenizer, artifact, member, base_sha256, backend, sample, export)
    config = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY",
              "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0, "INFERENCE_NUM_THREADS": threads or torch.get_num_threads()}
    return OpenVINOTrunk(compile_checked(core, target / "trunk.xml", config, backend), target)


def ensure_ir(model, tokenizer, artifact: Path, member: str, base_sha256: str, backend: str,
              sample: list | None = None, export: bool = True, copy_model: bool = True) -> Path:
    """The directory of the cached IR of ``backend`` for this adapter, exported first when missing (``export``;
    else FileNotFoundError). ``copy_model=False`` merges the LoRA into ``model`` itself (a process that exits
    after the export: no second copy of the weights at its memory peak)."""
    ir = IR_OF[backend]
    target = ir_path(artifact, member, base_sha256, backend, sample)
    if not (target / MARKER).is_file():
        if not export:
            raise FileNotFoundError(f"the {backend} IR of {artifact} is not built ({target})")
        log.info("exporting the trunk of %s for backend %s into %s: once per adapter, %s", artifact, backend,
                 target, "a few minutes (NNCF quantises it)" if ir == "openvino-int8" else "about a minute")
        _export(model, tokenizer, target, compress=ir == "openvino", sample=sample if ir == "openvino-int8" else None,
                copy_model=copy_model)
        log.info("exported %s; later starts load it in seconds", target)
    return target


class CompileCrashError(RuntimeError):
    """OpenVINO killed the process that compiled a trunk (a native fault, which no exception handler catches)."""


# Compiles an IR in a child process: exit 0 when it compiled (sys.argv: the IR, the config as JSON).
_COMPILE_PROBE = ("import json, sys, openvino as ov; "
                  "ov.Core().compile_model(sys.argv[1], 'CPU', json.loads(sys.argv[2]))")
COMPILE_PROBE_TIMEOUT_S = 600


def compile_checked(core, xml: Path, config: dict, backend: str):
    """``core.compile_model(xml, "CPU", config)``, once proven in a child process on this CPU with this OpenVINO
    and config (a marker in the cache records the proof). Some OpenVINO builds kill the process that compiles
    certain configurations: 2026.4.1 raises SIGFPE compiling the fp32 IR in bf16 with one thread on an AMX Xeon. In
    the service that would kill it at start; here it raises :class:`CompileCrashError` (a RuntimeError: ``auto``
    skips the candidate, a named backend fails with this message)."""
    import openvino as ov

    from ibedl.core.auto_backend import cpu_signature

    key = hashlib.sha256(json.dumps([sha256_file(xml), config, ov.__version__, cpu_signature()],
                                    sort_keys=True).encode()).hexdigest()[:16]  # the graph, not its weights
    proven = cache_dir() / "backends" / f"compiles-{key}"
    if not proven.is_file():
        try:
            done = subprocess.run([sys.executable, "-c", _COMPILE_PROBE, str(xml), json.dumps(config)],
                                  capture_output=True, text=True, timeout=COMPILE_PROBE_TIMEOUT_S,
                                  preexec_fn=expendable)
        except subprocess.TimeoutExpired as e:
            raise CompileCrashError(f"backend {backend!r}: OpenVINO {ov.__version__} did not compile {xml} within "
                                    f"{COMPILE_PROBE_TIMEOUT_S} s on this CPU (config {config})") from e
        if done.returncode != 0:
            code = done.returncode
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
            why = killed_reason(signal.Signals(-code).name, f"build {backend}") if code < 0 else ""
            tail = done.stderr.strip().splitlines()[-1:] or [""]
            raise CompileCrashError(f"backend {backend!r}: OpenVINO {ov.__version__} cannot compile {xml} on this CPU "
                                    f"(config {config}): the compiling process {how}{why} {tail[0]}".rstrip())
        try:
            proven.parent.mkdir(parents=True, exist_ok=True)
            proven.touch()
        except OSError:  # a read-only cache: prove it again at the next start
            pass
    return core.compile_model(str(xml), "CPU", config)


def runs_openvino(predictor) -> str | None:
    """Why OpenVINO cannot run this predictor's trunk, or None when it can."""
    if predictor.device.type != "cpu":
        return f"device {predictor.device}"
    if len(predictor.heads) > 1 or predictor.mc_samples > 0:
        return "MC-Dropout and ensembles run on torch"
    try:
        import openvino  # noqa: F401
    except ImportError:
        return "openvino is not installed (pip install -e '.[serve]')"
    return None


def has_nncf() -> bool:
    try:
        import nncf  # noqa: F401
    except ImportError:
        return False
    return True


def unavailable(backend: str, predictor, artifact: Path) -> str | None:
    """Why this machine cannot run ``backend`` for ``predictor`` (loaded from ``artifact``), or None when it can."""
    if backend == "torch":
        return None
    why = runs_openvino(predictor)
    if why is None and PRECISION_OF[backend] == "bf16" and not native_bf16():
        why = "this CPU has no native bfloat16"
    if why is None and IR_OF[backend] == "openvino-int8" and not has_nncf() and not int8_cached(predictor, artifact):
        why = "quantising needs NNCF (pip install -e '.[serve]') and its IR is not cached"
    return why


def _member(predictor) -> str:
    return predictor.manifest.members[0] if predictor.manifest else "."


def artifact_sample(predictor, artifact: Path) -> list | None:
    """The artifact's quantisation sample, encoded as one batch per question, each prompt whole whatever the
    predictor's token limit (the quantised trunk must not depend on it), or None when it carries none."""
    from ibedl.core import quantization_sample

    questions = quantization_sample.read(artifact)
    if questions is None:
        return None
    limit, predictor.max_tokens = predictor.max_tokens, QUANTIZATION_MAX_TOKENS
    try:
        return [predictor.encode([q], truncate_context=False) for q in questions]
    finally:
        predictor.max_tokens = limit


def int8_cached(predictor, artifact: Path, base_sha256: str = "") -> bool:
    """Whether the static int8 IR of this adapter and its artifact's quantisation sample is cached already."""
    sample = artifact_sample(predictor, artifact)
    if sample is None:
        return False
    sha = base_sha256 or predictor.manifest.base_model_ref().sha256
    return (ir_path(artifact, _member(predictor), sha, "openvino-int8", sample) / MARKER).is_file()


def build_trunk(backend: str, predictor, artifact: Path, base_sha256: str):
    """The trunk callable of ``backend`` for a loaded predictor; None for ``torch`` (the predictor's own path).
    A named backend is built (its IR exported once when not cached: minutes). ``auto`` builds nothing
    (ibedl.core.auto_backend.start_choice: the cached measurement's winner, else torch; what it weighed and what is
    still to build and time in ``predictor.backend_choice``). Records the concrete backend as ``predictor.backend``
    and why as ``predictor.backend_reason`` (logged when ``auto`` chose). ``openvino-int8`` is quantised on the
    artifact's quantisation sample (``predictor.quantized_on``: its file's sha256, which its calibration must
    record)."""
    from ibedl.core import auto_backend

    check_backend(backend)
    artifact = Path(artifact)
    if backend != "auto":
        trunk = _build(backend, predictor, artifact, base_sha256)
        predictor.backend, predictor.backend_reason = backend, "named"
    else:
        choice, trunk = auto_backend.start_choice(
            predictor, artifact, base_sha256, lambda name: _build(name, predictor, artifact, base_sha256, export=False),
            unavailable)
        predictor.backend, predictor.backend_reason, predictor.backend_choice = choice.backend, choice.reason, choice
        log.info("inference backend auto -> %s (%s)%s", choice.backend, choice.reason,
                 f"; measured again once {choice.path} is deleted" if choice.path and choice.cached else "")
        if choice.pending:
            log.warning("inference backend auto: %s not measured on this machine yet; serving %s meanwhile (%s)",
                        ", ".join(choice.pending), choice.backend, auto_backend.HOW_TO_MEASURE)
    mark_quantized(predictor, artifact)
    return trunk


def mark_quantized(predictor, artifact: Path) -> None:
    """Record which sample quantised a static int8 trunk (its calibration must match): ``predictor.quantized_on``."""
    from ibedl.core import quantization_sample

    predictor.quantized_on = (quantization_sample.sha256(artifact) if IR_OF.get(predictor.backend) == "openvino-int8"
                              else None)


def build_one(backend: str, predictor, artifact: Path, base_sha256: str, export: bool = True):
    """The trunk of the concrete ``backend`` (None for torch), its IR exported first when not cached (``export``;
    else FileNotFoundError)."""
    return _build(backend, predictor, Path(artifact), base_sha256, export)


def export_ir(backend: str, predictor, artifact: Path, base_sha256: str, copy_model: bool = True) -> Path:
    """Export the IR of ``backend`` for ``predictor`` into the cache (nothing compiled); its directory."""
    _check_openvino_predictor(backend, predictor)
    artifact = Path(artifact)
    encoded = artifact_sample(predictor, artifact) if IR_OF[backend] == "openvino-int8" else None
    return ensure_ir(predictor.model, predictor.tokenizer, artifact, _member(predictor), base_sha256, backend,
                     encoded, copy_model=copy_model)


def _check_openvino_predictor(backend: str, predictor) -> None:
    if len(predictor.heads) > 1 or predictor.mc_samples > 0:
        raise ValueError(
            f"backend {backend!r} serves single adapters only; MC-Dropout and ensembles need IBEDL_BACKEND=torch"
        )
    if predictor.device.type != "cpu":
        raise ValueError(f"backend {backend!r} runs on the CPU; got device {predictor.device}")


def _build(backend: str, predictor, artifact: Path, base_sha256: str, export: bool = True):
    if backend == "torch":
        return None
    _check_openvino_predictor(backend, predictor)
    encoded = artifact_sample(predictor, artifact) if IR_OF[backend] == "openvino-int8" else None
    return openvino_trunk(predictor.model, predictor.tokenizer, artifact, _member(predictor), base_sha256, backend,
                          sample=encoded, export=export)


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "check_backend", "calibration_key", "build_trunk", "build_one", "export_ir",
           "ensure_ir", "mark_quantized", "runs_openvino",
           "int8_cached", "ir_path", "compile_checked", "CompileCrashError", "LastTokenTrunk", "OpenVINOTrunk"]
