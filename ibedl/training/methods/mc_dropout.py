"""MC-Dropout: trained as MAP; predicts the mean softmax of ``mc_samples`` forward passes with the LoRA
dropout layers left on.

References:
    Gal and Ghahramani. Dropout as a Bayesian Approximation. ICML 2016.
"""

from ibedl.training.methods.base import Hyper, Method, StrictInt, count
from ibedl.training.methods.map import map_loss


class MCDropoutParams(Hyper):
    mc_samples: StrictInt = count(10)  # stochastic forward passes at prediction


METHOD = Method(name="mc_dropout", label="MCD", head="softmax", loss=map_loss, hyper=MCDropoutParams,
                mc_samples="mc_samples", reuses="map")
