"""Laplace-LoRA: trained as MAP; after training, a KFAC Laplace posterior over the LoRA weights is fitted on
``fit_samples`` training questions (prior precision: by default the value whose predictive has the lowest NLL on the
run's validation questions; ``marglik``: the marginal likelihood; or a number) and predicts with the GLM probit
approximation, or with ``predictive: mc`` the mean over ``samples`` weight draws from the posterior
(``ibedl.training.laplace_lora``, the ``laplace`` extra).

The artifact holds the MAP adapter; the posterior is fitted again from it and the training data (it is
not saved), so the service serves such an artifact's MAP predictive.

References:
    Yang et al. Bayesian Low-rank Adaptation for Large Language Models. ICLR 2024.
"""

import math

from ibedl.training.laplace_lora import PREDICTIVES, PRIORS, LaplacePredictor, fit_laplace
from ibedl.training.methods.base import Method, PostHoc
from ibedl.training.methods.map import map_loss


def check_params(params: dict) -> None:
    """Raise ValueError naming the first bad hyper-parameter."""
    for key in ("fit_samples", "batch_size", "samples"):
        value = params[key]
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
    prior = params["prior_precision"]
    number = isinstance(prior, (int, float)) and not isinstance(prior, bool)
    if not (prior in PRIORS or (number and math.isfinite(prior) and prior > 0)):
        raise ValueError(f"prior_precision must be one of {PRIORS} or a finite number > 0, got {prior!r}")
    if params["predictive"] not in PREDICTIVES:
        raise ValueError(f"predictive must be one of {PREDICTIVES}, got {params['predictive']!r}")


def fit(predictor, questions, validation, params):
    """The MAP predictor with the predictive (``glm`` or ``mc``) of a posterior fitted on the first ``fit_samples``
    questions, its prior precision chosen on ``validation`` unless ``prior_precision`` says otherwise."""
    laplace = fit_laplace(predictor, questions[: params["fit_samples"]], prior_precision=params["prior_precision"],
                          validation=validation, batch_size=params["batch_size"], predictive=params["predictive"],
                          samples=params["samples"])
    return LaplacePredictor(laplace, batch_size=params["batch_size"])


METHOD = Method(
    name="laplace",
    label="LA",
    head="softmax",
    loss=map_loss,
    defaults={"fit_samples": 200, "prior_precision": "validation", "batch_size": 4, "predictive": "glm", "samples": 10},
    check=check_params,
    posthoc=PostHoc(fit=fit),
    reuses="map",
)
