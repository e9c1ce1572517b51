"""The method registry: one module per method, one line here per method."""

from training.methods import edl, ib_edl, map
from training.methods.base import LossContext, Method

METHODS: dict[str, Method] = {}
METHODS["map"] = map.METHOD
METHODS["edl"] = edl.METHOD
METHODS["ib_edl"] = ib_edl.METHOD


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {sorted(METHODS)}")
    return METHODS[name]


__all__ = ["METHODS", "Method", "LossContext", "get_method"]
