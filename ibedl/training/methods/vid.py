"""VID: variational Dirichlet; -E_Dir[log pi_y] plus KL(Dir(alpha) || Dir(y * sg(alpha) + (1 - y))).

References:
    Chen et al. A Variational Dirichlet Framework for Out-of-Distribution Detection. 2018.
"""

from ibedl.training.losses import vid_loss
from ibedl.training.methods.base import Method


def loss(out, y, mask, params, ctx):
    return {"loss": vid_loss(out.alpha, y, mask)}


METHOD = Method(name="vid", label="VID", head="evidential", loss=loss, clip_grad_norm=20.0)
