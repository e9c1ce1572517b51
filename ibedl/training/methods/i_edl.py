"""I-EDL: Fisher-information-weighted MSE, minus fisher_weight x log det of the Fisher information, plus
EDL's annealed KL on wrong-option evidence.

References:
    Deng et al. Uncertainty Estimation by Fisher Information-based Evidential Deep Learning. ICML 2023.
    (fisher_weight 0.005 as in the authors' MNIST configuration.)
"""

from ibedl.training.losses import annealing, edl_kl_regulariser, fisher_mse
from ibedl.training.methods.base import Hyper, Method, Number, number


class IEDLParams(Hyper):
    fisher_weight: Number = number(0.005, ge=0)  # weight of the log det of the Fisher information
    kl_weight: Number = number(1.0, ge=0)


def loss(out, y, mask, params, ctx):
    risk, log_det = fisher_mse(out.alpha, y, mask)
    kl = edl_kl_regulariser(out.alpha, y, mask)
    total = risk - params["fisher_weight"] * log_det + annealing(ctx.epoch, ctx.epochs, params["kl_weight"]) * kl
    return {"loss": total, "risk": risk, "log_det_fisher": log_det, "kl": kl}


METHOD = Method(
    name="i_edl",
    label="I-EDL",
    head="evidential",
    loss=loss,
    hyper=IEDLParams,
    clip_grad_norm=20.0,
)
