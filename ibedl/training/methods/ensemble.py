"""Deep ensemble: ``members`` MAP adapters trained with different seeds, served as one artifact that
averages their softmax probabilities.

References:
    Lakshminarayanan et al. Simple and Scalable Predictive Uncertainty Estimation using Deep Ensembles. NeurIPS 2017.
"""

from ibedl.training.methods.base import Method
from ibedl.training.methods.map import map_loss

METHOD = Method(name="ensemble", label="Ens", head="softmax", loss=map_loss, defaults={"members": 3}, members="members")
