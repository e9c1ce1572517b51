import math

import numpy as np
import pytest

from benchmarks.evidential_readout import evidential_probs


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


@pytest.mark.parametrize("scale", [1.0, 4.0, 16.0])
def test_readout_is_the_dirichlet_mean_of_softplus_of_the_scaled_centred_log_probs(scale):
    p = [0.7, 0.2, 0.1]
    z = [math.log(x) for x in p]
    z = [x - sum(z) / 3 for x in z]
    alpha = [softplus(scale * x) + 1 for x in z]
    expected = [a / sum(alpha) for a in alpha]
    np.testing.assert_allclose(evidential_probs([p], scale)[0], expected, rtol=1e-5)


def test_readout_keeps_the_ranking_and_a_uniform_question_stays_uniform():
    out = evidential_probs([[0.1, 0.6, 0.3], [0.25] * 4], 8.0)
    assert np.argmax(out[0]) == 1 and np.argmin(out[0]) == 0
    np.testing.assert_allclose(out[1], [0.25] * 4, rtol=1e-6)
