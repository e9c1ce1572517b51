"""A CUDA trunk replayed from CUDA graphs (:class:`GraphedTrunk`): one graph per padded shape, captured once, so a
pass costs the GPU's time for its kernels and one launch, not the host's time to dispatch each of a forward's
thousands of operators.

Why: the H200's serving passes took 150-190 ms for about 3 questions of the 135M default
(benchmarks/results/gpu_serve_profile.json), about half what a test batch of 64 took: time that does not grow with
the pass, the mark of a forward bound by dispatching its ~6,000-12,000 ATen operators (benchmarks.merged_adapter)
rather than by computing them. A replayed graph launches them all at once.

How: a graph replays fixed shapes on fixed buffers. A batch of B prompts of S tokens is padded up to the smallest
captured (B', L') with B' >= B and L' >= S (:data:`BATCHES`, :data:`LENGTHS`, at most :data:`MAX_GRAPH_TOKENS`
tokens a graph), its ids copied into that graph's input buffer, the graph replayed and its first B rows of (B', d)
last-token states copied out. Rows beyond the largest batch captured at L' run in turn.

The forward (:meth:`GraphedTrunk.forward`) is the decoder under a causal mask alone, given as a 4-D additive mask
(one (1, 1, L, L) buffer per length): prompts are padded on the right (ibedl.core.predictor.Predictor's batches), so
under causal attention no real token reads a pad and a real token's state is a function of its own prompt alone; the
pads' ids never matter (:data:`PAD_ID`). The mask is explicit because transformers builds one itself while a CUDA
stream is capturing (it skips it otherwise, for ``is_causal``): with it given, a capture, its warm-up and a forward
outside any capture compute the same. A prompt longer than the longest length runs the same forward eagerly at its
own shape; a batch not padded on the right runs the eager trunk with its padding mask (``GraphedTrunk.counts``). The
graphed arithmetic is its own (the shapes a kernel sees), so a graphed backend has its own calibration key
(ibedl.core.backends.torch_cuda).

When: graphs are captured on the thread that will replay them (a capture on another thread would race the serving
passes' CUDA calls): each on first use, or all ahead with :meth:`GraphedTrunk.prepare`, which the engine runs on its
model thread at warm-up and before the background measurement times the trunk (ibedl.engine.capacity.warm_up,
ibedl.engine.backend_switch), each capture under ibedl.core.memory_limit.CUDA_CACHE (no other thread empties torch's
CUDA cache meanwhile). The graphs share one memory pool, captured largest first (so the smaller ones reuse its
blocks: they are captured on one side stream, as the allocator reuses a block only on the stream that freed it);
replays never overlap (one thread), and each copies its output out before the next. Each capture is checked at
once: its replay on other ids must compute what the forward computes on them (an empty or misdirected graph would
answer the capture's own input, a graph mixing rows the wrong row). A capture that fails raises
:class:`GraphCaptureError`, naming its shape: a failed build for ``auto`` (the service stays on the backend it
serves; the memory the failed capture took may stay held), and at start a service that says why.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from ibedl.core.memory_limit import CUDA_CACHE

log = logging.getLogger(__name__)

LENGTHS = (64, 128, 256, 512, 1024, 2048)  # padded prompt lengths a graph is captured at (the service's default
# limit is 1,024 prompt tokens; SciQ test prompts are 150-450)
BATCHES = (1, 2, 4, 8, 16, 32, 64)  # padded batch sizes (the service's default passes hold up to 16 questions)
MAX_GRAPH_TOKENS = 16384  # B' x L' of the largest graph: 36 graphs in all with the sizes above
PAD_ID = 0  # what fills a graph's input past a prompt's end: never read by a real token under causal attention
CHECK_ID = 1  # a capture's check replays row r on token CHECK_ID + r (any ids other than the capture's own input)
CHECK_TOLERANCE = 0.05  # a checked replay's row may differ from the forward's by this much of its norm (rounding of a
# kernel chosen differently; an empty or misdirected graph, or rows mixed up, differ by the rows' own size)
WARMUP_RUNS = 1  # eager runs of each shape on the capture's stream before it is captured (CUDA's advice)


class GraphCaptureError(RuntimeError):
    """A CUDA graph could not be captured, or its replay does not compute its forward."""


def graph_shapes(lengths=LENGTHS, batches=BATCHES, max_tokens: int = MAX_GRAPH_TOKENS) -> list[tuple[int, int]]:
    """Every (batch, length) a :class:`GraphedTrunk` captures, largest first (each later capture reuses the pool's
    blocks): the pairs of ``batches`` and ``lengths`` of at most ``max_tokens`` tokens. ValueError for an empty or
    non-positive size, or a bound no length fits one prompt of."""
    for name, sizes in (("lengths", lengths), ("batches", batches)):
        if not sizes or any(int(s) != s or s < 1 for s in sizes):
            raise ValueError(f"{name} must be positive integers, got {sizes!r}")
    if max_tokens < min(lengths):
        raise ValueError(f"max_tokens must hold one prompt of the shortest length {min(lengths)}, got {max_tokens}")
    return largest_first([(b, n) for n in lengths for b in batches if b * n <= max_tokens])


def largest_first(shapes) -> list[tuple[int, int]]:
    """The distinct (batch, length) ``shapes``, most tokens first (ties: the longer first)."""
    return sorted(set(shapes), key=lambda s: (-s[0] * s[1], -s[1]))


def smallest_at_least(n: int, sizes) -> int | None:
    """The smallest of ``sizes`` >= ``n``, None when none is."""
    return min((s for s in sizes if s >= n), default=None)


def right_padded(attention_mask: torch.Tensor, last_index: torch.Tensor) -> bool:
    """Whether each row of ``attention_mask`` (B, S) is ones up to its ``last_index`` (B,) and zeros after."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    expected = positions[None, :] <= last_index.to(attention_mask.device)[:, None]
    return bool(torch.equal(attention_mask.bool(), expected))


def causal_mask(length: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(1, 1, L, L) additive causal mask: 0 where a query may attend (keys at or before it), the dtype's minimum
    after. 4-D, so transformers takes it as it is, captured or not."""
    blocked = torch.full((length, length), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return blocked[None, None]


class Graph:
    """One captured shape: its input buffers ``ids`` (B', L') and ``last`` (B',), ``replay()`` and the (B', d)
    ``out`` buffer each replay overwrites."""

    def __init__(self, ids: torch.Tensor, last: torch.Tensor, replay: Callable[[], None], out: torch.Tensor) -> None:
        self.ids, self.last, self.replay, self.out = ids, last, replay, out


def cuda_capture(forward, ids: torch.Tensor, last: torch.Tensor, pool, stream) -> tuple[Callable[[], None],
                                                                                        torch.Tensor]:
    """Capture ``forward(ids, last)`` into a CUDA graph in memory ``pool`` on the buffers' device, after
    :data:`WARMUP_RUNS` eager runs, both on ``stream`` (a side stream of that device; the captures sharing a pool
    share it too: torch's allocator reuses a freed block only on the stream that freed it): (its replay, its output
    buffer). Capture errors are this thread's alone (``thread_local``): another thread's CUDA calls meanwhile
    neither fail nor spoil it."""
    device = ids.device
    with torch.cuda.device(device):
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                forward(ids, last)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            out = forward(ids, last)
    return graph.replay, out


class GraphedTrunk:
    """``trunk(batch)`` -> (B, d) last-token states of an encoded batch, replayed from CUDA graphs (module
    docstring).

    Args:
        trunk: the eager trunk (ibedl.core.backends.torch_cuda.TorchTrunk: ``model``, ``gather`` and ``device``); it
            answers a batch not padded on the right.
        shapes: the (batch, length) pairs to capture (default :func:`graph_shapes`), captured largest first.
        capture: ``capture(forward, ids, last) -> (replay, out)`` (default :func:`cuda_capture` in one memory pool
            and on one side stream for all the trunk's graphs; a test passes one that reruns ``forward`` on the
            buffers).
    """

    def __init__(self, trunk, shapes: list[tuple[int, int]] | None = None, capture=None) -> None:
        self.trunk = trunk
        self.model, self.device = trunk.model, trunk.device
        self.dtype = trunk.gather.decoder.get_input_embeddings().weight.dtype  # the queries' dtype: the mask's
        self.shapes = graph_shapes() if shapes is None else largest_first(shapes)
        if not self.shapes:
            raise ValueError("a graphed trunk needs at least one shape to capture")
        if capture is None:
            pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device=self.device)
            capture = lambda forward, ids, last: cuda_capture(forward, ids, last, pool, stream)  # noqa: E731
        self._capture = capture
        # length -> the batch sizes captured at it, ascending: what a pass's padding and split look up
        self._batches = {n: sorted(b for b, m in self.shapes if m == n) for n in sorted({n for _, n in self.shapes})}
        self.lengths = list(self._batches)
        self.graphs: dict[tuple[int, int], Graph] = {}
        self._masks: dict[int, torch.Tensor] = {}  # length -> its causal mask (one per captured length)
        self.counts: Counter = Counter()  # captured, replays, eager (longer than any length), masked (not right-padded)

    def _on_device(self):
        """The trunk's CUDA device as the current one (a graph replays on the current device's stream)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def forward(self, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """(B, d) states of each row's token ``last`` (B,) of right-padded ``ids`` (B, L), on the model's device: the
        decoder under a causal mask alone (module docstring); what each graph records."""
        mask = self._mask(ids.shape[1])
        states = self.trunk.gather.decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        return states[torch.arange(ids.shape[0], device=ids.device), last]

    def _mask(self, length: int) -> torch.Tensor:
        """The causal mask of ``length``, kept for a captured length (a graph reads it), made anew for another."""
        mask = self._masks.get(length)
        if mask is None:
            mask = causal_mask(length, self.dtype, self.device)
            if length in self._batches:
                self._masks[length] = mask
        return mask

    def capture(self, shape: tuple[int, int]) -> Graph:
        """The graph of ``shape`` (batch, length), captured now if it is not yet (on this thread: the one that
        replays it), and checked: replayed on other ids (each row its own, each reading another position), each
        row must be what :meth:`forward` computes on them, to :data:`CHECK_TOLERANCE` of its size.
        GraphCaptureError when the capture fails or the check does."""
        if shape in self.graphs:
            return self.graphs[shape]
        if shape not in self.shapes:
            raise ValueError(f"shape {shape} is not one this trunk captures")
        batch, length = shape
        ids = torch.full((batch, length), PAD_ID, dtype=torch.long, device=self.device)
        last = torch.zeros(batch, dtype=torch.long, device=self.device)
        with torch.no_grad(), self._on_device():
            self._mask(length)  # made before, not in, the graph
            try:
                with CUDA_CACHE:
                    replay, out = self._capture(self.forward, ids, last)
            except RuntimeError as e:  # torch.OutOfMemoryError too
                raise GraphCaptureError(f"capturing the CUDA graph of {batch} questions x {length} tokens failed: "
                                        f"{type(e).__name__}: {e}") from e
            rows = torch.arange(batch, device=self.device)
            vocab = self.trunk.gather.decoder.get_input_embeddings().num_embeddings
            ids.copy_(((CHECK_ID + rows) % vocab)[:, None].expand(batch, length))
            last.copy_((length - 1 - rows) % length)
            replay()
            expected = self.forward(ids, last).float()
            off = float(((out.float() - expected).norm(dim=1) / expected.norm(dim=1).clamp_min(1e-12)).max())
        if not off <= CHECK_TOLERANCE:
            raise GraphCaptureError(f"the CUDA graph of {batch} questions x {length} tokens, replayed, differs from "
                                    f"its forward by {off:.3g} of a row's size: the capture recorded other work")
        self.graphs[shape] = Graph(ids, last, replay, out)
        self.counts["captured"] += 1
        return self.graphs[shape]

    def prepare(self) -> Iterator[Callable[[], None]]:
        """One call per shape not captured yet, each capturing it, largest first: run them on the thread that will
        replay the graphs (the engine runs each between two passes)."""
        for shape in self.shapes:
            if shape not in self.graphs:
                yield lambda shape=shape: self.capture(shape)

    def __call__(self, batch) -> torch.Tensor:
        rows, width = batch.input_ids.shape
        if not right_padded(batch.attention_mask, batch.last_index):
            self.counts["masked"] += 1
            return self.trunk(batch)
        length = smallest_at_least(width, self.lengths)
        with torch.no_grad(), self._on_device():
            if length is None:  # longer than any graph: the same forward at its own shape
                self.counts["eager"] += 1
                return self.forward(batch.input_ids.to(self.device), batch.last_index.to(self.device))
            sizes = self._batches[length]
            outs = []
            for start in range(0, rows, sizes[-1]):
                ids, last = batch.input_ids[start:start + sizes[-1]], batch.last_index[start:start + sizes[-1]]
                n = ids.shape[0]
                graph = self.capture((smallest_at_least(n, sizes), length))
                padded = torch.full(tuple(graph.ids.shape), PAD_ID, dtype=torch.long)
                padded[:n, :width] = ids
                graph.ids.copy_(padded)
                graph.last.copy_(torch.nn.functional.pad(last, (0, graph.last.shape[0] - n)))
                graph.replay()
                outs.append(graph.out[:n].clone())
                self.counts["replays"] += 1
        return outs[0] if len(outs) == 1 else torch.cat(outs)


__all__ = ["GraphedTrunk", "Graph", "GraphCaptureError", "graph_shapes", "smallest_at_least", "right_padded",
           "causal_mask", "cuda_capture", "LENGTHS", "BATCHES", "MAX_GRAPH_TOKENS", "PAD_ID"]
