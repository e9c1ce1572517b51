"""What every OpenVINO backend shares: the LoRA-merged trunk exported once to OpenVINO IR and cached under
``IBEDL_CACHE_DIR/backends`` (keyed by base model, adapter, IR kind and, for static int8, the quantisation sample),
compiled in a precision after a child process proved the compile survives on this CPU, and :class:`OpenVINOBackend`,
the backend record each OpenVINO backend module declares with its IR kind, precision and needs.

IR kinds: ``openvino-fp32`` (the merged trunk as is; ``openvino-bf16`` runs it with bfloat16 matmuls), ``openvino``
(int8 weights, asymmetric, one scale per 64 input channels, decompressed inside the CPU plugin's matmul kernels;
activations stay fp32), ``openvino-int8`` (static int8 of weights and activations by NNCF post-training quantisation
on the artifact's quantisation sample, ibedl.core.quantization_sample).
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

CACHE_FORMAT = 1  # bump when the exported graph or its compression changes
QUANTIZATION_MAX_TOKENS = 1 << 20  # quantisation sample prompts are read whole (no context cut at a token limit)
# Measured on 30 SciQ validation questions (max |p - p_torch|): int8 per output channel (nncf's INT8 modes)
# 0.026-0.04; per 64 input channels 0.003. The plugin's dynamic int8 activations (groups of 16 / 64) added
# 0.017 / 0.034, so they are off (DYNAMIC_QUANTIZATION_GROUP_SIZE 0).
GROUP_SIZE = 64
FP32, INT8_WEIGHTS, STATIC_INT8 = "openvino-fp32", "openvino", "openvino-int8"  # the IR kinds
IR_KINDS = (FP32, INT8_WEIGHTS, STATIC_INT8)


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


def ir_path(artifact: Path, member: str, base_sha256: str, ir: str, sample: list | None = None) -> Path:
    """Where the IR of kind ``ir`` is cached for this adapter; static int8's also by its quantisation sample
    (ValueError without one: which quantisation would it be?)."""
    key = adapter_key(artifact, member, base_sha256, ir)
    if ir == STATIC_INT8:
        if not sample:
            raise ValueError("backend 'openvino-int8' quantises the trunk on the artifact's quantisation sample "
                             "(quantization_sample.jsonl), and it carries none: add one with python -m "
                             "ibedl.training.calibrate --artifact DIR --dataset NAME --backend openvino-int8")
        key = hashlib.sha256(f"{key}\0{sample_digest(sample)}".encode()).hexdigest()
    return cache_dir() / "backends" / f"{ir}-{key[:16]}"


def openvino_trunk(model, tokenizer, artifact: Path, member: str, base_sha256: str, backend: OpenVINOBackend,
                   threads: int | None = None, sample: list | None = None, export: bool = True) -> OpenVINOTrunk:
    """Compile the cached IR of this adapter, exporting it once if missing (``export``; else FileNotFoundError).
    ``sample``: the encoded batches ``openvino-int8`` is quantised on (once per adapter and sample; the cached IR is
    used after)."""
    try:
        import openvino as ov
    except ImportError as e:
        raise ImportError(f"backend {backend.name!r} needs openvino: pip install -e '.[serve]'") from e
    core = ov.Core()
    precision = backend.precision
    if precision == "bf16" and not native_bf16():
        raise ValueError(f"backend {backend.name!r} needs a CPU with native bfloat16 (AVX512-BF16 or AMX); this one "
                         f"has {', '.join(core.get_property('CPU', 'OPTIMIZATION_CAPABILITIES'))}: use openvino-fp32")
    target = ensure_ir(model, tokenizer, artifact, member, base_sha256, backend, sample, export)
    config = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY",
              "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0, "INFERENCE_NUM_THREADS": threads or torch.get_num_threads()}
    return OpenVINOTrunk(compile_checked(core, target / "trunk.xml", config, backend.name), target)


def ensure_ir(model, tokenizer, artifact: Path, member: str, base_sha256: str, backend: OpenVINOBackend,
              sample: list | None = None, export: bool = True, copy_model: bool = True) -> Path:
    """The directory of the cached IR of ``backend`` for this adapter, exported first when missing (``export``;
    else FileNotFoundError). ``copy_model=False`` merges the LoRA into ``model`` itself (a process that exits
    after the export: no second copy of the weights at its memory peak)."""
    ir = backend.ir
    target = ir_path(artifact, member, base_sha256, ir, sample)
    if not (target / MARKER).is_file():
        if not export:
            raise FileNotFoundError(f"the {backend.name} IR of {artifact} is not built ({target})")
        log.info("exporting the trunk of %s for backend %s into %s: once per adapter, %s", artifact, backend.name,
                 target, "a few minutes (NNCF quantises it)" if ir == STATIC_INT8 else "about a minute")
        _export(model, tokenizer, target, compress=ir == INT8_WEIGHTS, sample=sample if ir == STATIC_INT8 else None,
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

    from ibedl.core.cpu_isa import cpu_signature

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
    return (ir_path(artifact, _member(predictor), sha, STATIC_INT8, sample) / MARKER).is_file()


def _check_openvino_predictor(backend: str, predictor) -> None:
    """ValueError unless OpenVINO can serve ``predictor``'s trunk (one adapter, no MC-Dropout, the CPU)."""
    if len(predictor.heads) > 1 or predictor.mc_samples > 0:
        raise ValueError(
            f"backend {backend!r} serves single adapters only; MC-Dropout and ensembles need IBEDL_BACKEND=torch"
        )
    if predictor.device.type != "cpu":
        raise ValueError(f"backend {backend!r} runs on the CPU; got device {predictor.device}")


@dataclass(frozen=True)
class OpenVINOBackend:
    """An OpenVINO backend: the IR kind it runs (``ir``: openvino-fp32, openvino or openvino-int8), the precision its
    matmuls compute in (``precision``, the CPU plugin's INFERENCE_PRECISION_HINT: f32 or bf16), whether ``auto`` may
    choose it and what building it costs (``auto``, ``build_cost``: :class:`~ibedl.core.backends.base.Backend`), and
    what it needs beyond OpenVINO on the CPU. Its calibration key is its name (the precision is in it)."""

    name: str
    ir: str
    precision: str = "f32"
    auto: bool = False
    build_cost: int = 1

    def __post_init__(self) -> None:
        if self.ir not in IR_KINDS:
            raise ValueError(f"backend {self.name!r}: IR kind must be one of {IR_KINDS}, got {self.ir!r}")
        if self.precision not in ("f32", "bf16"):
            raise ValueError(f"backend {self.name!r}: precision must be f32 or bf16, got {self.precision!r}")
        if self.build_cost < 1:
            raise ValueError(f"backend {self.name!r}: build_cost must be >= 1 (an IR is built), got {self.build_cost}")

    @property
    def static_int8(self) -> bool:
        """Quantised on the artifact's quantisation sample (its calibration must record which, and the CPU int8
        class it was made on)."""
        return self.ir == STATIC_INT8

    def calibration_key(self, device="cpu", dtype="float32", load_in_4bit: bool = False) -> str:
        return self.name

    def owns_key(self, key: str) -> bool:
        return key == self.name

    def unavailable(self, predictor, artifact: Path) -> str | None:
        """Why this machine cannot run it for ``predictor`` (loaded from ``artifact``), or None when it can."""
        why = runs_openvino(predictor)
        if why is None and self.precision == "bf16" and not native_bf16():
            why = "this CPU has no native bfloat16"
        if why is None and self.static_int8 and not has_nncf() and not int8_cached(predictor, artifact):
            why = "quantising needs NNCF (pip install -e '.[serve]') and its IR is not cached"
        return why

    def build(self, predictor, artifact: Path, base_sha256: str, export: bool = True) -> OpenVINOTrunk:
        """The compiled trunk for ``predictor``, its IR exported first when not cached (``export``; else
        FileNotFoundError)."""
        _check_openvino_predictor(self.name, predictor)
        sample = artifact_sample(predictor, artifact) if self.static_int8 else None
        return openvino_trunk(predictor.model, predictor.tokenizer, artifact, _member(predictor), base_sha256, self,
                              sample=sample, export=export)

    def export(self, predictor, artifact: Path, base_sha256: str, copy_model: bool = True) -> Path:
        """Export its IR for ``predictor`` into the cache (nothing compiled); the IR's directory."""
        _check_openvino_predictor(self.name, predictor)
        sample = artifact_sample(predictor, artifact) if self.static_int8 else None
        return ensure_ir(predictor.model, predictor.tokenizer, artifact, _member(predictor), base_sha256, self, sample,
                         copy_model=copy_model)

    def quantized_on(self, artifact: Path) -> str | None:
        """sha256 of the quantisation sample file a static int8 trunk is quantised on; None for the others."""
        from ibedl.core import quantization_sample

        return quantization_sample.sha256(artifact) if self.static_int8 else None

