"""R-EDL: alpha = evidence + eta (a prior weight below 1), MSE without the variance term, annealed KL
towards Dir(eta); uncertainty mass u = C eta / alpha0.

References:
    Chen et al. R-EDL: Relaxing Nonessential Settings of Evidential Deep Learning. ICLR 2024.
"""

from ibedl.training.losses import annealing, relaxed_mse, wrong_evidence_kl
from ibedl.training.methods.base import Hyper, Method, Number, number


class REDLParams(Hyper):
    eta: Number = number(0.1, gt=0)  # alpha = evidence + eta
    kl_weight: Number = number(1.0, ge=0)


def loss(out, y, mask, params, ctx):
    risk = relaxed_mse(out.alpha, y, mask)
    kl = wrong_evidence_kl(out.alpha, y, mask, params["eta"])
    return {"loss": risk + annealing(ctx.epoch, ctx.epochs, params["kl_weight"]) * kl, "risk": risk, "kl": kl}


METHOD = Method(
    name="r_edl",
    label="R-EDL",
    head="evidential",
    loss=loss,
    hyper=REDLParams,
    clip_grad_norm=20.0,
    head_offset="eta",
)
