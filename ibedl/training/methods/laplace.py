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
from typing import Literal

from pydantic import field_validator

from ibedl.training.laplace_lora import PREDICTIVES, PRIORS, LaplacePredictor, fit_laplace
from ibedl.training.methods.base import Hyper, Method, Number, PredictiveFit, StrictInt, count
from ibedl.training.methods.map import map_loss


class LaplaceParams(Hyper):
    fit_samples: StrictInt = count(200)  # training questions the KFAC posterior is fitted on
    # "validation" | "marglik" | a number > 0
    prior_precision: Literal[PRIORS] | Number = "validation"
    batch_size: StrictInt = count(4)
    predictive: Literal[PREDICTIVES] = "glm"
    samples: StrictInt = count(10)  # weight draws of the mc predictive

    @field_validator("prior_precision", mode="before")
    @classmethod
    def _prior(cls, value):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (value in PRIORS or (number and math.isfinite(value) and value > 0)):
            raise ValueError(f"method_params.prior_precision must be one of {PRIORS} or a finite number > 0, "
                             f"got {value!r}")
        return value


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
    hyper=LaplaceParams,
    predictive_fit=PredictiveFit(fit=fit),
    reuses="map",
)
