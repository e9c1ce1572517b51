"""What a method is, in one record: its head and training objective, its hyper-parameters, how many adapters
it trains, its predictive (dropout passes) and an optional predictive fit after training."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationError

from ibedl.core.head import HeadPrediction
from ibedl.training.config_errors import describe

Number = StrictInt | StrictFloat  # a finite number as written (an int stays an int in the manifest)


class Hyper(BaseModel):
    """A method's hyper-parameters: typed, unknown keys refused, bounds in ``Field``; a subclass per method
    declares them with their defaults (:class:`Method` ``hyper``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def number(default, **bounds) -> Field:
    """A finite-number hyper-parameter with its default and ``ge``/``gt``/``le``/``lt`` bounds."""
    return Field(default, allow_inf_nan=False, **bounds)


def count(default: int, low: int = 1) -> Field:
    """A whole-number hyper-parameter >= ``low``."""
    return Field(default, ge=low)


@dataclass
class LossContext:
    """What a loss may need beyond outputs and targets.

    Attributes:
        progress: fraction of the step budget done, in [0, 1] (IB-EDL's optional beta annealing).
        epoch: the epoch this step belongs to, from 0.
        epochs: the epoch budget (``optim.epochs``); the EDL family's KL weight is min(1, epoch / epochs), set at
            each epoch's start as the reference code does (0 throughout the first epoch).
        generator: RNG for sampling losses (IB-EDL), seeded by the training loop.
    """

    progress: float = 1.0
    epoch: int = 0
    epochs: float = 1.0
    generator: torch.Generator | None = None


LossFn = Callable[[HeadPrediction, torch.Tensor, torch.Tensor, dict, LossContext], dict]


@dataclass(frozen=True)
class PredictiveFit:
    """A method's predictive fitted once the adapter is saved (Laplace's posterior, MAP+TS's temperature); the
    predictor it returns replaces the artifact's. Not the head's post-hoc parameter, which calibration fits
    (``Method.calibrates_posthoc``).

    Attributes:
        fit: ``fit(predictor, questions, validation, params) -> predictor``, fitted on the training ``questions``
            with any hyper-parameter chosen on the ``validation`` questions; the returned object answers ``predict``
            and ``eval`` like :class:`ibedl.core.predictor.Predictor` (``ibedl.training.evaluate`` runs it unchanged).
        samples: the hyper-parameter holding how many training questions it is fitted on; None for a step fitted on
            the validation questions alone (temperature scaling).
    """

    fit: Callable
    samples: str | None = "fit_samples"

    def num_samples(self, params: dict) -> int:
        return 0 if self.samples is None else int(params[self.samples])


@dataclass(frozen=True)
class Method:
    """A training method of the registry.

    Attributes:
        name: registry key (``map``, ``edl``, ``ib_edl``, ...).
        head: head kind in ``ibedl.core.head.HEADS``.
        loss: ``loss(out, y, mask, params, ctx) -> {"loss": (B,), <parts>: (B,)}``.
        hyper: the :class:`Hyper` model of its hyper-parameters (defaults and bounds); a config's ``method_params``
            override the defaults.
        clip_grad_norm: gradient clipping (20 for the EDL family as in the paper, 1 otherwise).
        head_offset: alpha = evidence + offset, from ``params`` key when a str, else the number.
        label: the method's short name in reports (``IB-EDL``).
        members: adapters trained with seeds seed, seed + 1000, ... and averaged (a deep ensemble);
            from ``params`` when a str, else the number.
        member_method: the method each member trains as (``map`` for the ensemble), or None for this one: a
            member's training is fingerprinted under it, so a run of that method with the same config and the
            member's seed is the same training and can stand in for it (``members_from``).
        mc_samples: the predictive's forward passes with dropout on (MC-Dropout), 0 for one deterministic
            pass; from ``params`` when a str, else the number.
        predictive_fit: a :class:`PredictiveFit` made after training (Laplace, MAP+TS), or None.
        confidence_ceiling: ``f(params, num_options) -> dict | None``, the highest confidence the
            objective allows at that option count (IB-EDL), or None when it has no ceiling.
        reuses: a method whose training run is the same as this one's (``map`` for MC-Dropout, Laplace and
            MAP+TS); the benchmark trains that run once and evaluates both on it.
        calibrates_posthoc: the calibration step (``ibedl.training.calibrate``) refits the head's post-hoc parameter:
            IB-EDL's zeta, MAP+TS's temperature; otherwise it stays neutral.
        frozen: ``f(params) -> names`` of head parameters that keep their initialisation (no gradient; an
            ablation), or None.
        head_options: ``f(params) -> {HeadConfig field: value}`` the head is built with (IB-EDL's sigma
            initialisation), or None.
        lr_scales: ``f(params) -> {head parameter name: factor}``: those head parameters train at factor x the
            head's learning rate (IB-EDL's sigma head), or None.
    """

    name: str
    head: str
    loss: LossFn
    hyper: type[Hyper] = Hyper
    clip_grad_norm: float = 1.0
    head_offset: float | str = 1.0
    label: str = ""
    members: int | str = 1
    member_method: str | None = None
    mc_samples: int | str = 0
    predictive_fit: PredictiveFit | None = None
    confidence_ceiling: Callable[[dict, int], dict | None] | None = None
    reuses: str | None = None
    calibrates_posthoc: bool = False
    frozen: Callable[[dict], tuple[str, ...]] | None = None
    head_options: Callable[[dict], dict] | None = None
    lr_scales: Callable[[dict], dict[str, float]] | None = None

    @property
    def defaults(self) -> dict:
        """Every hyper-parameter with its default value."""
        return self.hyper().model_dump()

    def params(self, overrides: dict | None = None) -> dict:
        """Defaults updated by ``overrides``, validated by the method's :class:`Hyper` model: an unknown key or a bad
        value is a ValueError naming the key and the value (``method_params.beta must be >= 0, got -1``)."""
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(self.hyper.model_fields))
        if unknown:
            raise ValueError(f"method {self.name!r} has no hyper-parameters {unknown}; "
                             f"known: {sorted(self.hyper.model_fields)}")
        try:
            return self.hyper(**overrides).model_dump()
        except ValidationError as e:
            raise ValueError(describe(e, self.hyper, prefix="method_params.")) from None

    @property
    def trained_as(self) -> str:
        """The method whose training run this one evaluates (itself unless it ``reuses`` another's)."""
        return self.reuses or self.name

    def offset(self, params: dict) -> float:
        return float(_value(self.head_offset, params))

    def num_members(self, params: dict) -> int:
        members = int(_value(self.members, params))
        if members < 1:
            raise ValueError(f"members must be >= 1, got {members}")
        return members

    def num_mc_samples(self, params: dict) -> int:
        return int(_value(self.mc_samples, params))


def _value(spec: float | int | str, params: dict):
    """A record field that is a number, or the name of the hyper-parameter that holds it."""
    return params[spec] if isinstance(spec, str) else spec
