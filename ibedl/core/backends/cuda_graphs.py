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
last-token states copied out. Rows beyond the largest batch captured at L' run in turn; prompts longer than the
longest length, and batches not padded on the right, run eagerly (``GraphedTrunk.eager``, counted). The forward is
the decoder without an attention mask: prompts are padded on the right (ibedl.core.predictor.Predictor's batches), so
under causal attention no real token reads a pad, and a real token's state is a function of its own prompt alone;
the pads' ids never matter (:data:`PAD_ID`). The graphed arithmetic is its own (the shapes a kernel sees, causal
attention without a mask), so a graphed backend has its own calibration key (ibedl.core.backends.torch_cuda).

When: graphs are captured on the thread that will replay them (a capture on another thread would race the serving
passes' CUDA calls): each on first use, or all ahead with :meth:`GraphedTrunk.prepare`, which the engine runs on its
model thread at warm-up and before the background measurement times the trunk (ibedl.engine.capacity.warm_up,
ibedl.engine.backend_switch). The graphs share one memory pool, captured largest first (so the smaller ones reuse
its blocks); replays never overlap (one thread), and each copies its output out before the next. A shape whose
capture fails runs the same forward eagerly on the same buffers (logged; ``GraphedTrunk.failed``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator

import torch

log = logging.getLogger(__name__)

LENGTHS = (64, 128, 256, 512, 1024, 2048)  # padded prompt lengths a graph is captured at (the service's default
# limit is 1,024 prompt tokens; SciQ test prompts are 150-450)
BATCHES = (1, 2, 4, 8, 16, 32, 64)  # padded batch sizes (the service's default passes hold up to 16 questions)
MAX_GRAPH_TOKENS = 16384  # B' x L' of the largest graph: 36 graphs in all with the sizes above
PAD_ID = 0  # what fills a graph's input past a prompt's end: never read by a real token under causal attention
WARMUP_RUNS = 1  # eager runs of each shape on the capture's stream before it is captured (CUDA's advice)


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


class Graph:
    """One captured shape: its input buffers ``ids`` (B', L') and ``last`` (B',), ``replay()`` and the (B', d)
    ``out`` buffer each replay overwrites."""

    def __init__(self, ids: torch.Tensor, last: torch.Tensor, replay: Callable[[], None], out: torch.Tensor) -> None:
        self.ids, self.last, self.replay, self.out = ids, last, replay, out


def cuda_capture(forward, ids: torch.Tensor, last: torch.Tensor, pool) -> tuple[Callable[[], None], torch.Tensor]:
    """Capture ``forward(ids, last)`` into a CUDA graph in memory ``pool``, after :data:`WARMUP_RUNS` eager runs on a
    side stream: (its replay, its output buffer). Capture errors are this thread's alone (``thread_local``): another
    thread's CUDA calls meanwhile neither fail nor spoil it."""
    stream = torch.cuda.Stream(device=ids.device)
    stream.wait_stream(torch.cuda.current_stream(ids.device))
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_RUNS):
            forward(ids, last)
    torch.cuda.current_stream(ids.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = forward(ids, last)
    return graph.replay, out


class GraphedTrunk:
    """``trunk(batch)`` -> (B, d) last-token states of an encoded batch, replayed from CUDA graphs (module
    docstring).

    Args:
        trunk: the eager trunk (ibedl.core.backends.torch_cuda.TorchTrunk: ``model``, ``gather`` and ``device``);
            it answers what no graph fits.
        shapes: the (batch, length) pairs to capture (default :func:`graph_shapes`), captured largest first.
        capture: ``capture(forward, ids, last) -> (replay, out)`` (default :func:`cuda_capture` in one shared
            pool; a test passes one that reruns ``forward`` on the buffers).
    """

    def __init__(self, trunk, shapes: list[tuple[int, int]] | None = None, capture=None) -> None:
        self.trunk = trunk
        self.model, self.device = trunk.model, trunk.device
        self.shapes = graph_shapes() if shapes is None else largest_first(shapes)
        if not self.shapes:
            raise ValueError("a graphed trunk needs at least one shape to capture")
        if capture is None:
            pool = torch.cuda.graph_pool_handle()
            capture = lambda forward, ids, last: cuda_capture(forward, ids, last, pool)  # noqa: E731
        self._capture = capture
        self.lengths = sorted({n for _, n in self.shapes})
        self.graphs: dict[tuple[int, int], Graph] = {}
        self.failed: dict[tuple[int, int], str] = {}  # shapes whose capture failed -> why (they run eagerly)
        self.counts: Counter = Counter()  # captured, capture_failed, replays, eager (batches no graph fits)

    def _forward(self, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        states = self.trunk.gather.decoder(input_ids=ids, use_cache=False).last_hidden_state
        return states[torch.arange(ids.shape[0], device=ids.device), last]

    def capture(self, shape: tuple[int, int]) -> Graph:
        """The graph of ``shape`` (batch, length), captured now if it is not yet (on this thread: the one that
        replays it). A capture that fails (a CUDA call it cannot record, no memory left) leaves that shape to the
        same forward run eagerly on the same buffers, the same arithmetic without the launch saving: logged, and
        recorded in ``failed`` and ``counts["capture_failed"]``."""
        if shape in self.graphs:
            return self.graphs[shape]
        if shape not in self.shapes:
            raise ValueError(f"shape {shape} is not one this trunk captures")
        batch, length = shape
        ids = torch.full((batch, length), PAD_ID, dtype=torch.long, device=self.device)
        last = torch.zeros(batch, dtype=torch.long, device=self.device)
        with torch.no_grad():
            try:
                replay, out = self._capture(self._forward, ids, last)
                self.counts["captured"] += 1
            except RuntimeError as e:  # torch.OutOfMemoryError too
                (log.warning if not self.failed else log.debug)(
                    "capturing the CUDA graph of %s questions x %s tokens failed (%s: %s): that shape runs eagerly",
                    batch, length, type(e).__name__, e)
                self.failed[shape] = f"{type(e).__name__}: {e}"
                self.counts["capture_failed"] += 1
                out = self._forward(ids, last)

                def replay(ids=ids, last=last, out=out):
                    with torch.no_grad():
                        out.copy_(self._forward(ids, last))
        self.graphs[shape] = Graph(ids, last, replay, out)
        return self.graphs[shape]

    def prepare(self) -> Iterator[Callable[[], None]]:
        """One call per shape not captured yet, each capturing it, largest first: run them on the thread that will
        replay the graphs (the engine runs each between two passes)."""
        for shape in self.shapes:
            if shape not in self.graphs:
                yield lambda shape=shape: self.capture(shape)

    def eager(self, batch) -> torch.Tensor:
        """What the eager trunk answers (with the attention mask)."""
        self.counts["eager"] += 1
        return self.trunk(batch)

    def __call__(self, batch) -> torch.Tensor:
        rows, width = batch.input_ids.shape
        length = smallest_at_least(width, self.lengths)
        if length is None or not right_padded(batch.attention_mask, batch.last_index):
            return self.eager(batch)
        most = max(b for b, n in self.shapes if n == length)
        outs = []
        with torch.no_grad():
            for start in range(0, rows, most):
                ids, last = batch.input_ids[start:start + most], batch.last_index[start:start + most]
                n = ids.shape[0]
                graph = self.capture((smallest_at_least(n, [b for b, m in self.shapes if m == length]), length))
                padded = torch.full(tuple(graph.ids.shape), PAD_ID, dtype=torch.long)
                padded[:n, :width] = ids
                graph.ids.copy_(padded)
                graph.last.copy_(torch.nn.functional.pad(last, (0, graph.last.shape[0] - n)))
                graph.replay()
                outs.append(graph.out[:n].clone())
                self.counts["replays"] += 1
        return outs[0] if len(outs) == 1 else torch.cat(outs)


__all__ = ["GraphedTrunk", "Graph", "graph_shapes", "smallest_at_least", "right_padded", "cuda_capture", "LENGTHS",
           "BATCHES", "MAX_GRAPH_TOKENS", "PAD_ID"]
