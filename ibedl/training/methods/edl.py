"""EDL: MSE Bayes risk of Dir(softplus(z) + 1) plus an annealed KL that removes wrong-option evidence.

References:
    Sensoy, Kaplan, Kandemir. Evidential Deep Learning to Quantify Classification Uncertainty. NeurIPS 2018.
"""

from ibedl.training.losses import annealing, edl_kl_regulariser, mse_bayes_risk
from ibedl.training.methods.base import Hyper, Method, Number, number


class EDLParams(Hyper):
    kl_weight: Number = number(1.0, ge=0)  # weight of the annealed KL term


def edl_loss(out, y, mask, params, ctx):
    risk = mse_bayes_risk(out.alpha, y, mask)
    kl = edl_kl_regulariser(out.alpha, y, mask)
    return {"loss": risk + annealing(ctx.epoch, ctx.epochs, params["kl_weight"]) * kl, "risk": risk, "kl": kl}


METHOD = Method(name="edl", label="EDL", head="evidential", loss=edl_loss, hyper=EDLParams,
                clip_grad_norm=20.0)
