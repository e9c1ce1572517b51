"""IB-EDL: a Gaussian over pre-evidence; K-sample MSE Bayes risk plus beta times KL(N(mu, sigma^2) || N(0, 1)).

References:
    Li et al. Calibrating LLMs with Information-Theoretic Evidential Deep Learning. ICLR 2025, Algorithm 1.
"""

from training.losses import gaussian_information, ib_edl_risk
from training.methods.base import Method


def ib_edl_loss(out, y, mask, params, ctx):
    risk = ib_edl_risk(out.logits, out.sigma, y, mask, params["num_samples"], ctx.generator)
    info = gaussian_information(out.logits, out.sigma, mask)
    return {"loss": risk + params["beta"] * info, "risk": risk, "info": info}


METHOD = Method(
    name="ib_edl",
    head="ib_edl",
    loss=ib_edl_loss,
    defaults={"beta": 1e-3, "num_samples": 20},
    clip_grad_norm=20.0,
    dirichlet=True,
)
