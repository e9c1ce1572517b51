"""MAP: cross-entropy on the softmax of the option logits (the usual fine-tuning)."""

from ibedl.training.losses import cross_entropy
from ibedl.training.methods.base import Method


def map_loss(out, y, mask, params, ctx):
    return {"loss": cross_entropy(out.logits, y, mask)}


METHOD = Method(name="map", label="MAP", head="softmax", loss=map_loss)
