"""The served adapters, without the HTTP server: loading one or several artifacts on one shared base model, and
each adapter's runtime (predictor view, thresholds, prediction sets, answer reference). The engine builds its
adapters here (``Engine.load`` and ``Engine.open``, whatever door serves it); nothing here imports FastAPI."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ibedl.core import arithmetic, backends
from ibedl.core.artifact import Abstention, Conformal, ServedCalibration
from ibedl.core.base_model import check_device
from ibedl.core.predictor import Prediction, Predictor
from ibedl.engine.errors import UnknownAdapter
from ibedl.engine.settings import EngineSettings
from ibedl.engine.thread_tokenizer import PerThreadTokenizer

log = logging.getLogger("ibedl.engine")


@dataclass
class AdapterRuntime:
    """One served adapter: its predictor (a view of the shared base model with its own PEFT adapter and head),
    the calibration it serves with (made on its backend), default abstention thresholds and stored prediction sets
    from it, and the ``adapter`` field of its answers. What a front door watches (the service's drift monitors and
    accuracy estimates) it keeps itself, by adapter name."""

    name: str
    predictor: Predictor
    calibration: ServedCalibration  # the manifest's calibration in use (made on the backend, unless overridden)
    ref: dict  # the "adapter" field of every answer: name, method, version, backend, calibration
    count_tokenizers: PerThreadTokenizer  # a copy per thread for counting tokens (the model thread owns the original)

    @property
    def dirichlet(self) -> bool:
        """Whether its answers carry a Dirichlet (belief masses and an uncertainty mass): not a softmax head's."""
        return self.predictor.head.dirichlet

    @property
    def thresholds(self) -> Abstention:
        return self.calibration.thresholds

    @property
    def conformal(self) -> Conformal | None:
        """Stored conformal quantiles (None: never calibrated)."""
        return self.calibration.conformal

    @property
    def option_counts(self) -> list[int] | None:
        """The option counts of the calibration sample in use (None: not recorded, older calibrations)."""
        counts = self.calibration.record.get("option_counts")
        return None if counts is None else [int(c) for c in counts]

    @property
    def calibration_matches(self) -> bool:
        """Whether the calibration in use was made on the backend and precision that serve."""
        p = self.predictor
        elsewhere = arithmetic.mismatch(backends.get(p.backend), self.calibration.record, p.quantized_on) is not None
        return self.calibration.key == p.calibration_key and not elsewhere

    @property
    def drift_statistic(self) -> str:
        """What drift is measured on: the uncertainty mass when the calibration's reference has it, else confidence."""
        return "uncertainty_mass" if self.calibration.reference.get("uncertainty") is not None else "confidence"

    @property
    def watched_options(self) -> int | None:
        """The option count whose answers drift and the label-free accuracy estimate watch: the one the calibration's
        reference was drawn from (a per-count calibration's main count, or a sample's only count; older calibrations:
        the count the post-hoc step was fitted on, else their one claimed count, which a calibration that is not per
        count claims only when its sample held that count alone). None: every count (a reference that mixes counts)."""
        if "options" in self.calibration.reference:
            options = self.calibration.reference["options"]
        else:
            options = (self.calibration.record.get("posthoc") or {}).get("fitted_on_options")
            if options is None and self.option_counts is not None and len(self.option_counts) == 1:
                options = self.option_counts[0]
        return None if options is None else int(options)

    def reference(self) -> list:
        """The calibration sample's values of :attr:`drift_statistic` that served values are compared with."""
        key = "uncertainty" if self.drift_statistic == "uncertainty_mass" else "confidence"
        return self.calibration.reference.get(key)

    def predict(self, questions) -> list[Prediction]:
        """The model's predictions; a prompt over the served token limit is refused, never cut (requests are
        checked against that limit before they get here)."""
        return self.predictor.predict(questions, truncate_context=False)


def load_predictors(settings: EngineSettings) -> list[Predictor]:
    """The default loader: the base model once, with the adapter of every artifact of ``settings`` on it."""
    check_device(settings.device)  # a CUDA device this machine lacks: said so, not torch's error mid-load
    if settings.threads:
        torch.set_num_threads(settings.threads)
    return Predictor.from_artifacts(
        settings.served_artifacts(),
        base_model=settings.base_model,
        device=settings.device,
        load_in_4bit=settings.load_in_4bit,
        allow_base_mismatch=settings.allow_base_mismatch,
        backend=settings.backend,
    )


def make_runtimes(predictors: list[Predictor], settings: EngineSettings,
                  keep_model: bool = False) -> dict[str, AdapterRuntime]:
    """One runtime per predictor, by adapter name (in order: the first is the default). Refuses predictors
    without a manifest, two adapters of one name, and weights that hold NaN or inf. The torch model a backend's trunk
    answers without is dropped, unless ``keep_model`` (the service's background switcher exports and times with it)."""
    if not predictors:
        raise ValueError("no adapters to serve")
    bad = nonfinite_weights(predictors)
    if bad:
        raise ValueError(f"{len(bad)} weight tensors hold NaN or inf (first: {', '.join(bad[:3])}); "
                         "the artifact is broken: retrain or restore it")
    # one base model: one tokenizer (a pass takes the check's ids only on predictors holding this very object; a
    # loader giving each predictor a tokenizer of its own makes their passes tokenise again, slower, never wrong)
    count_tokenizers = PerThreadTokenizer(predictors[0].tokenizer)
    runtimes: dict[str, AdapterRuntime] = {}
    for predictor in predictors:
        manifest = predictor.manifest
        if manifest is None:
            raise ValueError("the loader returned a predictor without a manifest")
        if manifest.name in runtimes:
            raise ValueError(f"two adapters are named {manifest.name!r}; adapters served together need distinct "
                             "manifest names")
        # Served prompts may be longer than the training cut (manifest prompt.max_tokens): the model reads
        # them whole; only what exceeds this limit is refused.
        predictor.max_tokens = settings.max_tokens
        if settings.pad_freely:  # one forward per pass, padded to its longest prompt (a switch's copy keeps it)
            predictor.max_padding = math.inf
        calibration = served_calibration(predictor, settings)
        runtimes[manifest.name] = AdapterRuntime(
            name=manifest.name,
            predictor=predictor,
            calibration=calibration,
            ref={"name": manifest.name, "method": manifest.method, "version": str(manifest.version),
                 "backend": predictor.backend, "calibration": calibration.key},
            count_tokenizers=count_tokenizers,
        )
    for predictor in predictors:  # checked: the torch weights an OpenVINO trunk no longer needs are dropped
        if predictor.trunk is not None and not keep_model:
            predictor.release_model()
    return runtimes


def switched(runtime: AdapterRuntime, backend: str, trunk, reason: str, choice, artifact: Path,
             settings: EngineSettings) -> AdapterRuntime:
    """The runtime of the same adapter answering on ``backend`` (``trunk``; None: the torch model) with the
    calibration made on it: a new object beside ``runtime``, which stays whole (its predictor, heads, calibration and
    ``ref``), so a pass queued on it before a switch is answered on it and under its calibration.
    UncalibratedBackend when the artifact carries no calibration for ``backend``."""
    predictor = copy.copy(runtime.predictor)
    # the calibration sets the heads' post-hoc parameter: the old runtime keeps its own
    predictor.heads = [copy.deepcopy(h) for h in runtime.predictor.heads]
    predictor.serve_on(backends.Built(trunk, backend, reason, choice, backends.quantized_on(backend, artifact)))
    calibration = served_calibration(predictor, settings)
    return dataclasses.replace(runtime, predictor=predictor, calibration=calibration,
                               ref={**runtime.ref, "backend": backend, "calibration": calibration.key})


def recalibrated(runtime: AdapterRuntime, manifest, settings: EngineSettings) -> AdapterRuntime:
    """The runtime of the same adapter and weights under a newer version of its manifest (a recalibration: new
    thresholds, sets, drift reference and post-hoc parameter, the same weight files): a new object beside
    ``runtime``, which stays whole, so a pass queued on it is answered under its own calibration, as a backend switch
    is (:func:`switched`). ValueError when ``manifest`` is not a recalibration of the served one (another adapter,
    other weights, base model, members or prompt: those need a restart), UncalibratedBackend when it carries no
    calibration for the backend that serves."""
    old = runtime.predictor.manifest
    if manifest.name != old.name:
        raise ValueError(f"the manifest names adapter {manifest.name!r}, not the served {old.name!r}")
    changed = [what for what, a, b in (("weight files", manifest.files, old.files), ("members", manifest.members,
                                                                                      old.members),
                                       ("base model", manifest.base_model, old.base_model),
                                       ("method", manifest.method, old.method), ("prompt", manifest.prompt, old.prompt))
               if a != b]
    if changed:
        raise ValueError(f"version {manifest.version} of adapter {manifest.name!r} changes its {', '.join(changed)}: "
                         "not a recalibration of the served weights; restart the service to serve it")
    predictor = copy.copy(runtime.predictor)
    # the calibration sets the heads' post-hoc parameter: the old runtime keeps its own
    predictor.heads = [copy.deepcopy(h) for h in runtime.predictor.heads]
    predictor.manifest = manifest
    predictor.use_calibration()
    calibration = served_calibration(predictor, settings)
    return dataclasses.replace(runtime, predictor=predictor, calibration=calibration,
                               ref={**runtime.ref, "version": str(manifest.version), "calibration": calibration.key})


class UncalibratedBackend(ValueError):
    """The artifact carries no calibration made on the backend that would serve it. The message names the adapter,
    backends and calibration keys only (no path, hash or setting value), so readiness may show it whole."""


def served_calibration(predictor: Predictor, settings: EngineSettings) -> ServedCalibration:
    """The calibration ``predictor`` serves with: the manifest's one made on its backend and precision. When the
    manifest carries none, UncalibratedBackend saying so and what to do, unless
    ``settings.allow_uncalibrated_backend``
    (then the manifest's top-level calibration, with a warning)."""
    manifest, key = predictor.manifest, predictor.calibration_key
    if predictor.calibration is None:  # a predictor built without from_artifacts: look it up now
        predictor.use_calibration()
    if predictor.calibration is not None:
        why = arithmetic.mismatch(backends.get(predictor.backend), predictor.calibration.record,
                                  predictor.quantized_on)
        if why is None:
            return predictor.calibration
        if not settings.allow_uncalibrated_backend:
            raise UncalibratedBackend(
                f"adapter {manifest.name!r}: its {key} calibration does not hold for the "
                f"{'int8 trunk' if backends.get(predictor.backend).static_int8 else 'bfloat16 arithmetic'} served: "
                f"{why}. "
                f"Recalibrate it on this backend (python -m ibedl.training.calibrate --artifact DIR --dataset NAME "
                f"--backend {predictor.backend}), serve another backend it carries (IBEDL_BACKEND), or set "
                "IBEDL_ALLOW_UNCALIBRATED_BACKEND=true to serve it anyway")
        log.warning("adapter %s: serving backend %s with a calibration that does not hold for its trunk (%s; "
                    "IBEDL_ALLOW_UNCALIBRATED_BACKEND)", manifest.name, predictor.backend, why)
        return predictor.calibration
    carried = manifest.calibration_keys()
    if not settings.allow_uncalibrated_backend:
        raise UncalibratedBackend(
            f"adapter {manifest.name!r} carries no calibration made on backend {predictor.backend} ({key}); it "
            f"carries {', '.join(carried)}. Its thresholds and conformal quantiles hold for the arithmetic they were "
            f"calibrated on: calibrate it on this backend (python -m ibedl.training.calibrate --artifact DIR "
            f"--dataset NAME --backend {predictor.backend}), serve a backend it carries (IBEDL_BACKEND), or set "
            f"IBEDL_ALLOW_UNCALIBRATED_BACKEND=true to serve the {carried[0]} calibration anyway")
    log.warning("adapter %s: serving backend %s (%s) with the calibration made on %s "
                "(IBEDL_ALLOW_UNCALIBRATED_BACKEND): its guarantees were made on other arithmetic",
                manifest.name, predictor.backend, key, carried[0])
    return manifest.calibration_for(carried[0])


def find_adapter(runtimes: dict[str, AdapterRuntime], name: str | None, field: str = "adapter") -> AdapterRuntime:
    """The adapter called ``name`` among ``runtimes`` (None: the default, the first); UnknownAdapter naming the
    ones there otherwise. The one adapter lookup of
    the service and the Python API."""
    if name is None:
        return next(iter(runtimes.values()))
    if name not in runtimes:
        raise UnknownAdapter(f"no adapter {name!r} is served; choose one of {list(runtimes)}", field)
    return runtimes[name]


def finite_prediction(p: Prediction) -> bool:
    """Every number of a prediction is finite (a NaN or inf must never become an answer)."""
    values = [p.confidence, *p.probs, *(p.alpha or ()), *(p.belief or ()), *(p.sigma or ())]
    if p.uncertainty is not None:
        values.append(p.uncertainty)
    return all(math.isfinite(v) for v in values)


def nonfinite_weights(predictors: list[Predictor]) -> list[str]:
    """Names of the parameters and buffers (base, adapters and heads) that hold a NaN or inf; the shared base
    model is read once."""
    bad, seen = [], set()
    modules = []
    for predictor in predictors:
        if id(predictor.model) not in seen:
            seen.add(id(predictor.model))
            modules.append(("model", predictor.model))
        modules += [(f"{predictor.manifest.name if predictor.manifest else ''}.head{i}".lstrip("."), h)
                    for i, h in enumerate(predictor.heads)]
    for prefix, module in modules:
        if not isinstance(module, torch.nn.Module):  # a released model (None) was checked before its release
            continue
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad.append(f"{prefix}.{name}")
    return bad
