"""The graphed CUDA trunk (ibedl.core.backends.cuda_graphs): a batch padded up to a captured shape, its ids written
into that shape's buffers, the graph replayed and its rows copied out.

On the CPU a capture cannot be made: these tests pass :func:`rerun_capture`, whose replay runs the captured forward
again on the same buffers, so everything but CUDA's recording is the code that serves (which shape a batch takes,
what is written into the buffers and read back, the split of a long batch, the eager fallbacks, the order of the
captures). The tests at the end capture real graphs on a GPU only."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from ibedl.core import auto_backend, backends, memory_limit
from ibedl.core.backends import REGISTRY, cuda_graphs, torch_cuda
from ibedl.core.backends.cuda_graphs import (
    GraphCaptureError,
    GraphedTrunk,
    graph_shapes,
    right_padded,
    smallest_at_least,
)
from ibedl.core.backends.torch_cuda import TorchCudaBackend, load_trunk
from ibedl.core.predictor import EncodedBatch, Predictor
from ibedl.core.prompt import MCQuestion

GRAPHS = ["torch-cuda-graphs-fp32", "torch-cuda-graphs-bf16"]
WORDS = ["sun", "moon", "water", "plant", "stone", "tree", "bird", "fish", "cloud", "river"]


def questions(n: int, start: int = 0) -> list[MCQuestion]:
    """``n`` questions of different prompt lengths (a context of 0..n words)."""
    return [MCQuestion(f"Which is {WORDS[(start + i) % 10]}?", ("sun", "moon", "tree"),
                       context=" ".join(WORDS[: (start + i) % 10]) or None) for i in range(n)]


class Captures:
    """A capture for the CPU: its replay reruns the forward on the captured buffers into the output buffer, each run
    with ``torch.cuda.is_current_stream_capturing()`` true, as transformers sees it inside a real capture. Records
    the shapes captured and the replays; ``empty=True`` makes replays do nothing (a graph that recorded no work)."""

    def __init__(self, empty: bool = False) -> None:
        self.shapes: list[tuple[int, int]] = []
        self.replays = 0
        self.empty = empty

    @staticmethod
    def capturing(forward, ids, last):
        with mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True):
            return forward(ids, last)

    def __call__(self, forward, ids, last):
        self.shapes.append(tuple(ids.shape))
        out = self.capturing(forward, ids, last)

        def replay():
            self.replays += 1
            if not self.empty:
                out.copy_(self.capturing(forward, ids, last))

        return replay, out


@pytest.fixture(scope="module")
def predictor(tiny_artifact) -> Predictor:
    return Predictor.from_artifact(tiny_artifact, device="cpu", dtype=torch.float32, backend="torch")


@pytest.fixture(scope="module")
def merged(predictor, tiny_artifact):
    """The tiny artifact's adapter merged into its fp32 base on the CPU: the eager trunk a graphed backend wraps."""
    sha = predictor.manifest.base_model_ref().sha256
    return load_trunk(predictor.model.name_or_path, sha, tiny_artifact / predictor.manifest.members[0], "cpu",
                      "float32", False, merged=True)


def graphed(trunk, shapes=((4, 64), (2, 64), (1, 64), (2, 128), (1, 128))) -> tuple[GraphedTrunk, Captures]:
    """A graphed ``trunk`` of ``shapes`` (the toy questions take 30-68 tokens) capturing on the CPU."""
    captures = Captures()
    return GraphedTrunk(trunk, list(shapes), captures), captures


class TestShapes:
    def test_the_default_shapes_fit_the_token_bound_largest_first(self):
        shapes = graph_shapes()
        assert len(shapes) == 36 and len(set(shapes)) == 36
        assert all(b * n <= cuda_graphs.MAX_GRAPH_TOKENS for b, n in shapes)
        assert {n for _, n in shapes} == set(cuda_graphs.LENGTHS) and {b for b, _ in shapes} == set(cuda_graphs.BATCHES)
        sizes = [b * n for b, n in shapes]
        assert sizes == sorted(sizes, reverse=True) and shapes[0][0] * shapes[0][1] == cuda_graphs.MAX_GRAPH_TOKENS
        assert (64, 256) in shapes and (64, 512) not in shapes and (8, 2048) in shapes and shapes[-1] == (1, 64)

    def test_a_small_bound_keeps_the_shapes_that_fit(self):
        assert graph_shapes((64, 128), (1, 2, 4), 256) == [(2, 128), (4, 64), (1, 128), (2, 64), (1, 64)]

    @pytest.mark.parametrize(("args", "message"), [
        (((), (1,), 64), "lengths must be positive integers, got \\(\\)"),
        (((64,), (0, 1), 64), "batches must be positive integers, got \\(0, 1\\)"),
        (((64.5,), (1,), 128), "lengths must be positive integers, got \\(64.5,\\)"),
        (((64,), (1,), 32), "max_tokens must hold one prompt of the shortest length 64, got 32"),
    ])
    def test_bad_sizes_are_refused_by_name(self, args, message):
        with pytest.raises(ValueError, match=message):
            graph_shapes(*args)

    def test_smallest_at_least(self):
        assert [smallest_at_least(n, (64, 128, 256)) for n in (1, 64, 65, 256, 257)] == [64, 64, 128, 256, None]

    def test_right_padding_is_told_from_other_masks(self, predictor):
        batch = predictor.encode(questions(4))
        assert right_padded(batch.attention_mask, batch.last_index)
        left = batch.attention_mask.flip(1)
        assert not right_padded(left, batch.last_index)
        holed = batch.attention_mask.clone()
        holed[0, 0] = 0
        assert not right_padded(holed, batch.last_index)
        assert not right_padded(batch.attention_mask, batch.last_index - 1)


class TestGraphedTrunk:
    def test_a_replay_answers_what_the_masked_trunk_answers(self, predictor, merged):
        """Padded to a captured shape, under the causal mask alone, each prompt's last-token state is the masked
        trunk's to fp32's rounding: no real token reads a pad."""
        trunk, captures = graphed(merged)
        for n in (1, 2, 3, 4):
            batch = predictor.encode(questions(n))
            got, expected = trunk(batch), merged(batch)
            assert got.shape == expected.shape == (n, predictor.model.config.hidden_size)
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), float((got - expected).abs().max())
        assert captures.shapes == [(1, 64), (2, 64), (4, 64)]  # each on first use, once
        assert trunk.counts == {"captured": 3, "replays": 4} and captures.replays == 4 + 3  # a check a capture

    def test_what_the_buffers_held_before_never_reaches_an_answer(self, predictor, merged):
        """Three questions after four in the same graph (its fourth row and longer ids still in the buffer) get what
        they get alone, in a fresh trunk."""
        trunk, _ = graphed(merged)
        first = trunk(predictor.encode(questions(4, start=4)))  # 46-59 tokens: the same graph as the next
        kept = first.clone()
        batch = predictor.encode(questions(3))
        alone, _ = graphed(merged)
        assert torch.equal(trunk(batch), alone(batch))
        assert torch.allclose(trunk(batch), merged(batch), rtol=1e-5, atol=1e-5)
        assert torch.equal(first, kept)  # an answer handed out is the caller's: the next replay leaves it alone

    def test_rows_beyond_the_largest_graph_run_in_turn(self, predictor, merged):
        trunk, captures = graphed(merged)
        batch = predictor.encode(questions(7))  # at most 4 rows a graph at length 64: 4, then 3 in the same graph
        assert batch.input_ids.shape[1] <= 64
        got = trunk(batch)
        assert torch.allclose(got, merged(batch), rtol=1e-5, atol=1e-5)
        assert captures.shapes == [(4, 64)] and trunk.counts["replays"] == 2
        batch = predictor.encode(questions(6))  # 4, then 2 in a smaller graph
        assert torch.allclose(trunk(batch), merged(batch), rtol=1e-5, atol=1e-5)
        assert captures.shapes == [(4, 64), (2, 64)] and trunk.counts["replays"] == 4

    def test_a_longer_prompt_takes_the_next_length_and_one_past_all_runs_the_same_forward_eagerly(self, predictor,
                                                                                                 merged):
        trunk, captures = graphed(merged)
        batch = predictor.encode(questions(2, start=8))  # 63 and 68 tokens
        assert batch.input_ids.shape[1] == 68
        assert torch.allclose(trunk(batch), merged(batch), rtol=1e-5, atol=1e-5) and captures.shapes == [(2, 128)]
        short, captures = graphed(merged, [(2, 64)])
        got = short(batch)
        assert short.counts == {"eager": 1} and captures.shapes == []  # at its own width, no graph
        assert torch.equal(got, short.forward(batch.input_ids, batch.last_index))
        assert torch.allclose(got, merged(batch), rtol=1e-5, atol=1e-5)

    def test_a_batch_not_padded_on_the_right_runs_the_masked_trunk(self, predictor, merged):
        trunk, captures = graphed(merged)
        batch = predictor.encode(questions(2, start=3))
        width = batch.input_ids.shape[1]
        lengths = batch.attention_mask.sum(1)
        shift = [int(width - n) for n in lengths]
        left = EncodedBatch(torch.stack([torch.roll(r, s) for r, s in zip(batch.input_ids, shift, strict=True)]),
                            torch.stack([torch.roll(r, s) for r, s in zip(batch.attention_mask, shift, strict=True)]),
                            torch.full_like(batch.last_index, width - 1), batch.option_mask)
        assert torch.equal(trunk(left), merged(left)) and trunk.counts == {"masked": 1} and captures.shapes == []

    def test_prepare_captures_each_shape_not_yet_captured_largest_first(self, predictor, merged):
        trunk, captures = graphed(merged)
        trunk(predictor.encode(questions(2)))
        steps = list(trunk.prepare())
        assert captures.shapes == [(2, 64)] and len(steps) == 4  # nothing captured until a step runs
        for step in steps:
            step()
        assert captures.shapes == [(2, 64), (2, 128), (4, 64), (1, 128), (1, 64)]
        assert list(trunk.prepare()) == [] and list(backends.preparation(trunk)) == []
        for n in (1, 3, 4):
            trunk(predictor.encode(questions(n)))
        assert len(captures.shapes) == 5  # served from what was prepared
        assert list(backends.preparation(merged)) == [] and list(backends.preparation(None)) == []

    def test_a_capture_that_fails_or_replays_nothing_is_an_error_naming_its_shape(self, predictor, merged):
        """After a failed capture torch's allocator is not fit to go on: the error is raised, named (a failed build for
        auto). A graph that recorded no work (e.g. kernels sent to another device's stream) would answer every batch
        with its capture's own states: the check replays it on other ids and refuses it."""
        def refused(forward, ids, last):
            raise RuntimeError("operation not permitted when stream is capturing")

        trunk = GraphedTrunk(merged, [(2, 64)], refused)
        with pytest.raises(GraphCaptureError, match="the CUDA graph of 2 questions x 64 tokens failed: RuntimeError: "
                                                    "operation not permitted when stream is capturing"):
            trunk(predictor.encode(questions(2)))
        empty = GraphedTrunk(merged, [(2, 64)], Captures(empty=True))
        with pytest.raises(GraphCaptureError, match="2 questions x 64 tokens, replayed, differs from its forward by "
                                                    "[0-9.e-]+ of a row's size"):
            for step in empty.prepare():
                step()
        assert trunk.graphs == empty.graphs == {} and isinstance(GraphCaptureError("x"), RuntimeError)

    def test_a_graph_that_mixes_its_rows_fails_its_check(self, merged):
        """The check gives each row its own ids and position: a graph answering every row with its first row's state
        (rows mixed up) is refused."""
        captures = Captures()

        def first_row_everywhere(forward, ids, last):
            replay, out = captures(forward, ids, last)

            def mixed():
                replay()
                out.copy_(out[:1].expand_as(out))

            return mixed, out

        trunk = GraphedTrunk(merged, [(2, 64)], first_row_everywhere)
        with pytest.raises(GraphCaptureError, match="differs from its forward"):
            trunk.capture((2, 64))

    def test_each_capture_holds_the_cuda_cache_lock(self, merged):
        """No thread empties torch's CUDA cache while a graph is captured (memory_limit.CUDA_CACHE): an empty_cache
        during a capture fails torch's allocator."""
        held = []
        captures = Captures()

        def capture(forward, ids, last):
            held.append(memory_limit.CUDA_CACHE.locked())
            return captures(forward, ids, last)

        trunk = GraphedTrunk(merged, [(2, 64), (1, 64)], capture)
        for step in trunk.prepare():
            step()
        assert held == [True, True] and not memory_limit.CUDA_CACHE.locked()

    def test_a_real_capture_runs_on_the_trunks_device_and_one_side_stream(self, merged, monkeypatch):
        """cuda_capture, its CUDA calls faked: warm-up and capture run with the buffers' device current and on the
        trunk's one side stream, in its one pool, errors kept to this thread; every capture of a trunk shares them (the
        allocator reuses a block only on the stream that freed it)."""
        import contextlib

        calls = []

        class Stream:
            def __init__(self, device=None):
                calls.append(("stream", device))

            def wait_stream(self, other):
                pass

        @contextlib.contextmanager
        def recording(name, *args, **kwargs):
            calls.append((name, *args, *sorted(kwargs.items())))
            yield

        class Graph:
            def replay(self):
                pass

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("current"))
        monkeypatch.setattr(torch.cuda, "device", lambda device: recording("device", device))
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: recording("stream as current", type(stream).__name__))
        monkeypatch.setattr(torch.cuda, "graph", lambda graph, **kw: recording("graph", **{k: v if k != "stream" else
                                                                                          type(v).__name__
                                                                                          for k, v in kw.items()}))
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        trunk = GraphedTrunk(merged, [(2, 64), (1, 64)])
        stream_made = calls[:]
        for shape in ((2, 64), (1, 64)):
            ids = torch.zeros(shape, dtype=torch.long)
            replay, out = trunk._capture(trunk.forward, ids, torch.zeros(shape[0], dtype=torch.long))
            assert out.shape == (shape[0], merged.model.config.hidden_size)
        device = torch.device("cpu")
        assert stream_made == [("stream", device)] and ("stream", device) not in calls[1:]  # one side stream
        graph = ("graph", ("capture_error_mode", "thread_local"), ("pool", "pool"), ("stream", "Stream"))
        assert [c for c in calls[1:] if c[0] != "stream"] == [("device", device), ("stream as current", "Stream"),
                                                              graph] * 2

    def test_a_capture_computes_what_the_forward_computes_outside_one(self, predictor, merged, monkeypatch):
        """transformers builds its own attention mask while a CUDA stream captures and skips it otherwise (for
        is_causal: another kernel on a GPU; on this CPU the two agree bit for bit, so the test reads what attention
        is given): the forward gives it the causal mask, so the graph, its warm-up and any forward outside a capture
        run the same attention, on the same (1, 1, L, L) mask."""
        import transformers.models.llama.modeling_llama as llama

        given = []
        real = llama.ALL_ATTENTION_FUNCTIONS["sdpa"]

        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            given.append(None if attention_mask is None else (tuple(attention_mask.shape), attention_mask.dtype))
            return real(module, query, key, value, attention_mask, *args, **kwargs)

        monkeypatch.setitem(llama.ALL_ATTENTION_FUNCTIONS, "sdpa", attention)
        assert merged.model.config._attn_implementation == "sdpa"
        trunk, captures = graphed(merged)
        got = trunk(predictor.encode(questions(3)))
        graph = trunk.graphs[(4, 64)]
        layers = merged.model.config.num_hidden_layers
        # the capture, its check's replay and forward, the batch's replay: all under the capture's mask
        assert given == [((1, 1, 64, 64), torch.float32)] * layers * 4
        outside = trunk.forward(graph.ids, graph.last)
        assert given[-1] == ((1, 1, 64, 64), torch.float32) and len(given) == layers * 5
        assert torch.equal(graph.out, outside) and torch.equal(got, outside[:3])
        mask = cuda_graphs.causal_mask(3, torch.float32, "cpu")[0, 0]
        assert torch.equal(mask == 0, torch.ones(3, 3, dtype=torch.bool).tril())

    def test_a_shape_it_does_not_capture_is_refused(self, merged):
        trunk, _ = graphed(merged)
        with pytest.raises(ValueError, match="shape \\(8, 64\\) is not one this trunk captures"):
            trunk.capture((8, 64))
        with pytest.raises(ValueError, match="needs at least one shape"):
            GraphedTrunk(merged, [], Captures())

    def test_served_by_the_predictor_its_answers_are_the_merged_trunks(self, tiny_artifact, merged):
        """The head reads a graphed trunk's states as it reads any trunk's (ibedl.core.predictor)."""
        served = Predictor.from_artifact(tiny_artifact, device="cpu", dtype=torch.float32, backend="torch")
        served.serve_on(backends.Built(graphed(merged)[0], "torch-cuda-graphs-fp32"))
        plain = Predictor.from_artifact(tiny_artifact, device="cpu", dtype=torch.float32, backend="torch")
        plain.serve_on(backends.Built(merged, "torch-cuda-merged-fp32"))
        qs = questions(7)
        for a, b in zip(served.predict(qs), plain.predict(qs), strict=True):
            assert a.probs == pytest.approx(b.probs, abs=1e-5)


class TestBackend:
    @pytest.mark.parametrize("name", GRAPHS)
    def test_a_graphed_backend_keys_an_arithmetic_of_its_own(self, name):
        backend = REGISTRY[name]
        assert backend.graphs and backend.merged and not backend.load_in_4bit
        assert name == torch_cuda.graphs_key(backend.dtype)
        for loaded_as in [("cpu", "float32", False), ("cuda", backend.dtype, False)]:
            assert backends.calibration_key(name, *loaded_as) == name
        assert backends.of_key(name) is backend and [n for n, b in REGISTRY.items() if b.owns_key(name)] == [name]

    def test_a_graphed_backend_is_the_merged_trunk_and_named_for_it(self):
        with pytest.raises(ValueError, match="the graphed trunk is the merged one"):
            TorchCudaBackend("torch-cuda-graphs-bf16", "bfloat16", graphs=True)
        with pytest.raises(ValueError, match="arithmetic: 'torch-cuda-graphs-bf16', got 'torch-cuda-merged-bf16'"):
            TorchCudaBackend("torch-cuda-merged-bf16", "bfloat16", merged=True, graphs=True)

    def test_on_the_cpu_it_says_why_and_on_cuda_it_builds_the_merged_trunk_graphed(self, tiny_artifact, predictor,
                                                                                  monkeypatch):
        for name in GRAPHS:
            assert backends.unavailable(name, predictor, tiny_artifact) == "it runs on CUDA; this predictor is on cpu"
        monkeypatch.setattr(Predictor, "device", property(lambda self: torch.device("cuda", 0)))
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
        calls = []
        monkeypatch.setattr(torch_cuda, "load_trunk", lambda *args: calls.append(args) or "merged trunk")
        monkeypatch.setattr(torch_cuda, "GraphedTrunk", lambda trunk: ("graphed", trunk))
        built = backends.build_one("torch-cuda-graphs-bf16", predictor, tiny_artifact, "sha", export=False)
        assert built == ("graphed", "merged trunk")
        assert calls[-1][4:] == ("bfloat16", False, True)  # merged, not 4-bit

    def test_auto_times_it_where_the_artifact_carries_its_calibration(self, tiny_artifact, tmp_path, monkeypatch):
        from tests.core.test_backends_torch_cuda import carrying

        artifact = carrying(tiny_artifact, tmp_path / "a", ["torch-cuda-bf16", "torch-cuda-graphs-bf16"])
        loaded = Predictor.from_artifact(artifact, device="cpu", dtype=torch.bfloat16, backend="torch")
        monkeypatch.setattr(Predictor, "device", property(lambda self: torch.device("cuda", 0)))
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
        names, skipped = auto_backend.candidates(loaded, artifact, backends.unavailable)
        assert names == ["torch-cuda-graphs-bf16", "torch"]
        assert "no calibration made on it (torch-cuda-graphs-fp32)" in skipped["torch-cuda-graphs-fp32"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs on a GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_a_gpu_a_replay_is_the_forward_at_its_shape(tiny_artifact, dtype):
    """A real capture: a replay computes what the same forward computes eagerly on the padded batch (the same
    kernels: within one rounding of the precision), and each answer is the masked trunk's to its precision's
    rounding; graphs replayed in another order than they were captured in still answer their own shapes."""
    reference = Predictor.from_artifact(tiny_artifact, device="cuda", dtype=getattr(torch, dtype), backend="torch")
    sha = reference.manifest.base_model_ref().sha256
    eager = load_trunk(reference.model.name_or_path, sha, tiny_artifact / reference.manifest.members[0], "cuda",
                       dtype, False, merged=True)
    trunk = GraphedTrunk(eager, [(4, 64), (2, 64), (1, 64)])
    for step in trunk.prepare():
        step()
    assert len(trunk.graphs) == 3
    for n in (3, 1, 4, 2):
        batch = reference.encode(questions(n))
        got = trunk(batch)
        graph = trunk.graphs[(smallest_at_least(n, (1, 2, 4)), 64)]
        with torch.no_grad():
            padded = torch.zeros(tuple(graph.ids.shape), dtype=torch.long)
            padded[:n, :batch.input_ids.shape[1]] = batch.input_ids
            last = torch.nn.functional.pad(batch.last_index, (0, graph.ids.shape[0] - n))
            expected = trunk.forward(padded.cuda(), last.cuda())[:n]
        assert got.is_cuda and got.dtype == getattr(torch, dtype)
        scale = expected.float().abs().max()
        assert float((got.float() - expected.float()).abs().max() / scale) <= (1e-6 if dtype == "float32" else 8e-3)
        masked = eager(batch).float()
        assert float((got.float() - masked).abs().max() / masked.abs().max()) < (1e-4 if dtype == "float32" else 3e-2)
    assert trunk.counts == {"replays": 4, "captured": 3}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs on a GPU")
def test_on_a_gpu_the_backend_serves_through_its_graphs(tiny_artifact):
    """Served by name, the backend captures its graphs at the engine's warm-up (every shape, each checked) and
    answers through them."""
    import ibedl

    model = ibedl.load(tiny_artifact, device="cuda", backend="torch-cuda-graphs-bf16",
                       allow_uncalibrated_backend=True)
    try:
        trunk = model.engine.default.predictor.trunk
        assert isinstance(trunk, GraphedTrunk) and trunk.counts["captured"] == len(graph_shapes())
        before = trunk.counts["replays"]
        answers = model.predict([{"question": q.question, "options": list(q.options)} for q in questions(5)])
        assert len(answers) == 5 and trunk.counts["replays"] > before
        assert trunk.counts["eager"] == trunk.counts["masked"] == 0
    finally:
        model.close()
