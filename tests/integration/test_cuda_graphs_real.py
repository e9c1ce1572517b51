"""The graphed trunk's forward (ibedl.core.backends.cuda_graphs) on the real model and default adapter: real SciQ
prompts padded on the right up to the captured shapes, under the causal mask alone, give the trunk's last-token
states under its padding mask and the same answers (on the CPU, with the tests' stand-in capture, which reruns the
forward on the buffers as a capture sees it)."""

import pytest

from ibedl.core.backends import Built
from ibedl.core.backends.cuda_graphs import GraphedTrunk, graph_shapes
from ibedl.core.backends.torch_cuda import TorchTrunk
from ibedl.core.predictor import Predictor
from ibedl.training.data import load_dataset
from tests.core.test_backends_cuda_graphs import Captures
from tests.integration.conftest import DEFAULT_ARTIFACT


def test_the_default_padded_to_graph_shapes_answers_as_with_its_padding_mask(real_model_ref):
    predictor = Predictor.from_artifact(DEFAULT_ARTIFACT, device="cpu", backend="torch")
    predictor.max_padding = float("inf")  # one forward a batch, padded to its longest prompt: the mask matters most
    questions = load_dataset("sciq", "validation", limit=12, seed=3)
    eager = TorchTrunk(predictor.model)
    shapes = [(b, n) for b, n in graph_shapes() if b * n <= 2048]  # at most 2,048 tokens a graph: 12 run in turn
    trunk = GraphedTrunk(eager, shapes, Captures())
    for n in (1, 3):
        batch = predictor.encode(questions[:n])
        expected, got = eager(batch), trunk(batch)
        assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5
    masked = predictor.predict(questions)
    predictor.serve_on(Built(trunk, "torch-cuda-graphs-fp32"))
    for a, b in zip(predictor.predict(questions), masked, strict=True):
        assert a.index == b.index and a.probs == pytest.approx(b.probs, abs=1e-5)
    assert trunk.counts["eager"] == 0 and trunk.counts["replays"] >= 2 + 2  # 12 rows: 8 a graph at most (256 tokens)
