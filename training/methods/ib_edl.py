"""IB-EDL: a Gaussian over pre-evidence; the K-sample Bayes risk plus beta times KL(N(mu, sigma^2) || N(0, 1)).

``risk`` picks the paper's expected loss under the sampled pre-evidence: ``mse`` (eq. L_IB-MSE, the
paper's default) or ``nll`` (eq. L_IB-NLL: log alpha0 - log alpha_y, the exact -log p(y | z)).

References:
    Li et al. Calibrating LLMs with Information-Theoretic Evidential Deep Learning. ICLR 2025, Algorithm 1.
"""

from training.losses import gaussian_information, ib_edl_risk
from training.methods.base import Method


def ib_edl_loss(out, y, mask, params, ctx):
    risk = ib_edl_risk(out.logits, out.sigma, y, mask, params["num_samples"], ctx.generator, params["risk"])
    info = gaussian_information(out.logits, out.sigma, mask)
    return {"loss": risk + params["beta"] * info, "risk": risk, "info": info}


METHOD = Method(
    name="ib_edl",
    head="ib_edl",
    loss=ib_edl_loss,
    defaults={"beta": 1e-3, "num_samples": 20, "risk": "mse"},
    clip_grad_norm=20.0,
    dirichlet=True,
)
