"""Deep ensemble: ``members`` MAP adapters trained with different seeds, served as one artifact that
averages their softmax probabilities. Each member trains as MAP does (``member_method``): the first, seeded
with the run's seed, is MAP's run of that seed, which ``members_from`` can copy instead of training it again.

References:
    Lakshminarayanan et al. Simple and Scalable Predictive Uncertainty Estimation using Deep Ensembles. NeurIPS 2017.
"""

from ibedl.training.methods.base import Hyper, Method, StrictInt, count
from ibedl.training.methods.map import map_loss


class EnsembleParams(Hyper):
    members: StrictInt = count(3)  # MAP adapters, seeds s, s + 1000, ...


METHOD = Method(name="ensemble", label="Ens", head="softmax", loss=map_loss, hyper=EnsembleParams,
                members="members", member_method="map")
