"""The method registry: one module per method, one line here per method, in the order reports list them."""

from ibedl.training.methods import edl, ensemble, i_edl, ib_edl, laplace, map, map_ts, mc_dropout, r_edl, vid
from ibedl.training.methods.base import LossContext, Method, PredictiveFit

METHODS: dict[str, Method] = {}
METHODS["map"] = map.METHOD
METHODS["map_ts"] = map_ts.METHOD
METHODS["mc_dropout"] = mc_dropout.METHOD
METHODS["ensemble"] = ensemble.METHOD
METHODS["laplace"] = laplace.METHOD
METHODS["edl"] = edl.METHOD
METHODS["vid"] = vid.METHOD
METHODS["i_edl"] = i_edl.METHOD
METHODS["r_edl"] = r_edl.METHOD
METHODS["ib_edl"] = ib_edl.METHOD


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {sorted(METHODS)}")
    return METHODS[name]


__all__ = ["METHODS", "Method", "LossContext", "PredictiveFit", "get_method"]
