"""MAP with temperature scaling: trained as MAP; the predictive probabilities become softmax(log p / T) with the
temperature T of the lowest NLL on the run's validation questions (the baseline a user reaches for first).

The grid evaluates it on MAP's trained run (``reuses``); ``python -m ibedl.training.finetune`` with ``method: map_ts``
trains MAP and fits T in its calibration step, on the validation split's fit part, as IB-EDL fits zeta.

References:
    Guo, Pleiss, Sun, Weinberger. On Calibration of Modern Neural Networks. ICML 2017.
"""

import numpy as np

from ibedl.training.methods.base import Method, PredictiveFit
from ibedl.training.methods.map import map_loss


def fit(predictor, questions, validation, params):
    """The MAP predictor with its head's temperature fitted on ``validation`` (NLL over calibrate's grid)."""
    from ibedl.training.evaluate import predict_all
    from ibedl.training.head_kinds import fit_temperature

    predictor.head.config.temperature = 1.0
    preds, _ = predict_all(predictor, validation, progress=False)
    temperature, info = fit_temperature([np.asarray(p.probs, dtype=np.float64) for p in preds],
                                        [q.answer for q in validation])
    predictor.head.config.temperature = temperature
    predictor.predictive_fit_info = {"temperature": temperature, "n": len(validation), **info}
    return predictor


METHOD = Method(name="map_ts", label="MAP+TS", head="softmax", loss=map_loss,
                predictive_fit=PredictiveFit(fit=fit, samples=None), reuses="map", calibrates_posthoc=True)
