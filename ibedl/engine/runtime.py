"""The served adapters, without the HTTP server: loading one or several artifacts on one shared base model, and
each adapter's runtime (predictor view, thresholds, prediction sets, answer reference). The service
(``ibedl.serve.state``) and the Python API (``ibedl``) both build their adapters here; nothing here imports FastAPI."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from ibedl.core.artifact import Abstention, Conformal
from ibedl.core.predictor import Prediction, Predictor
from ibedl.engine.errors import UnknownAdapter
from ibedl.engine.settings import EngineSettings


@dataclass
class AdapterRuntime:
    """One served adapter: its predictor (a view of the shared base model with its own PEFT adapter and head),
    default abstention thresholds, stored prediction sets and the ``adapter`` field of its answers. The service
    adds its drift monitor and accuracy estimate."""

    name: str
    predictor: Predictor
    thresholds: Abstention
    conformal: Conformal | None  # stored conformal quantiles (None: never calibrated)
    ref: dict  # the "adapter" field of every answer: name, method, version
    count_tokenizer: object  # a copy for counting tokens off the model's thread (the model's thread owns the original)
    drift: object | None = None  # ibedl.engine.drift.DriftMonitor, service only
    accuracy: object | None = None  # ibedl.engine.drift.AccuracyEstimate, service only

    @property
    def drift_statistic(self) -> str:
        """What drift is measured on: the uncertainty mass when the manifest's reference has it, else confidence."""
        reference = self.predictor.manifest.reference
        return "uncertainty_mass" if reference.get("uncertainty") is not None else "confidence"

    def reference(self) -> list:
        """The validation sample of :attr:`drift_statistic` that served values are compared with."""
        key = "uncertainty" if self.drift_statistic == "uncertainty_mass" else "confidence"
        return self.predictor.manifest.reference.get(key)

    def predict(self, questions) -> list[Prediction]:
        """The model's predictions; a prompt over the served token limit is refused, never cut (requests are
        checked against that limit before they get here)."""
        return self.predictor.predict(questions, truncate_context=False)


def load_predictors(settings: EngineSettings) -> list[Predictor]:
    """The default loader: the base model once, with the adapter of every artifact of ``settings`` on it."""
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


def make_runtimes(predictors: list[Predictor], settings: EngineSettings) -> dict[str, AdapterRuntime]:
    """One runtime per predictor, by adapter name (in order: the first is the default). Refuses predictors
    without a manifest, two adapters of one name, and weights that hold NaN or inf."""
    if not predictors:
        raise ValueError("no adapters to serve")
    bad = nonfinite_weights(predictors)
    if bad:
        raise ValueError(f"{len(bad)} weight tensors hold NaN or inf (first: {', '.join(bad[:3])}); "
                         "the artifact is broken: retrain or restore it")
    count_tokenizer = copy.deepcopy(predictors[0].tokenizer)  # one base model: one tokenizer
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
        runtimes[manifest.name] = AdapterRuntime(
            name=manifest.name,
            predictor=predictor,
            thresholds=manifest.thresholds(),
            conformal=manifest.conformal_sets(),
            ref={"name": manifest.name, "method": manifest.method, "version": str(manifest.version)},
            count_tokenizer=count_tokenizer,
        )
    return runtimes


def find_adapter(runtimes: dict[str, AdapterRuntime], name: str | None, field: str = "adapter",
                 where: str = "served") -> AdapterRuntime:
    """The adapter called ``name`` among ``runtimes`` (None: the default, the first); UnknownAdapter naming the
    ones there otherwise (``where``: how the message calls them, "served" or "loaded"). The one adapter lookup of
    the service and the Python API."""
    if name is None:
        return next(iter(runtimes.values()))
    if name not in runtimes:
        raise UnknownAdapter(f"no adapter {name!r} is {where}; choose one of {list(runtimes)}", field)
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
        if not isinstance(module, torch.nn.Module):
            continue
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad.append(f"{prefix}.{name}")
    return bad
