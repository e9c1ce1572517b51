"""Where the engine's time goes when it answers on CUDA: the bound of the service's answers/s on a GPU.

    python -m benchmarks.gpu_serve_profile --artifact runs/gpu_check/default-cuda [--questions 512]
        [--settings 16:2048,64:32768,64:32768:loose,256:131072:loose] [--backends torch-cuda-graphs-bf16,torch]
        [--output benchmarks/results/gpu_serve_profile.json]

For each backend (the artifact must carry its calibration: the check's calibrate step makes them), and for each
engine setting ``max_batch_size:max_batch_tokens``, the Python API (the engine the service runs, without
HTTP) answers the same distinct SciQ training questions, with their passages, in requests of ``max_batch_size``
questions: answers/s, the passes the batcher formed (count and mean size), the seconds inside
``Predictor.predict`` (the forward passes and turning their outputs into answers) and, of those, inside the
trunk's forward with the GPU synchronised before and after (its kernels' time); what is left of the wall time is
the engine's own work (queueing, checks, answers). A setting ending in ``:loose`` serves with ``pad_freely``
(``IBEDL_PAD_FREELY``): it lifts the two length rules made for a CPU, where padding costs compute (a pass takes
questions within a factor 2 of its first prompt's length, and runs them in groups padded to at most 1.25x their real
tokens), so each pass is one forward of up to ``max_batch_size`` questions. Then a cProfile of the passes of the last
setting names the Python functions that take the most time, and torch's profiler one pass's operators by their CPU
and CUDA time (whether the pass waits on kernels or on launching them). A graphed trunk's rows also say how its
forwards went (``graph_counts``: graphs captured, replays, forwards without a graph). The backends run in the order
given, the
graphed one first by default: the eager torch rows were measured before (the committed result's first version).
Needs CUDA (exits 2 without it, saying why);
made for ``make gpu-check``'s machine after its calibrate step (that step writes runs/gpu_check/default-cuda).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

from benchmarks.common import operator_table, write_result


def parse_settings(text: str) -> list[tuple[int, int, bool]]:
    """``"16:2048,64:32768:loose"`` -> [(16, 2048, False), (64, 32768, True)]; ValueError naming a bad item."""
    out = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        parts = item.split(":")
        try:
            if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "loose"):
                raise ValueError
            triple = (int(parts[0]), int(parts[1]), len(parts) == 3)
        except ValueError:
            raise ValueError(f"--settings: expected max_batch_size:max_batch_tokens[:loose], got {item!r}") from None
        if triple[0] < 1 or triple[1] < 16:
            raise ValueError(f"--settings: {item!r} needs max_batch_size >= 1 and max_batch_tokens >= 16")
        out.append(triple)
    if not out:
        raise ValueError("--settings: no setting given")
    return out


def measure(artifact: str, bodies: list[dict], size: int, tokens: int, profile: cProfile.Profile | None,
            device: str = "cuda", loose: bool = False, backend: str = "torch") -> dict:
    """One setting: the engine on ``device`` and ``backend`` answering ``bodies`` in requests of ``size`` (the
    trunk's time with the GPU synchronised where ``device`` is CUDA; the tests run it on a CPU); ``loose``: served
    with ``pad_freely`` (module docstring)."""
    import torch

    import ibedl

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    model = ibedl.load(artifact, device=device, backend=backend, max_batch_size=size, max_batch_tokens=tokens,
                       queue_size=max(len(bodies), 256), max_request_tokens=max(16384, 2 * tokens),
                       request_timeout_s=600, pad_freely=loose)
    predictor = model.engine.default.predictor
    passes, inside, trunk, forwards = [], [0.0], [0.0], [0]
    predict, hidden = predictor.predict, predictor._hidden

    def timed_hidden(batch):
        sync()
        start = time.perf_counter()
        out = hidden(batch)
        sync()
        trunk[0] += time.perf_counter() - start
        forwards[0] += 1
        return out

    def timed_predict(questions, truncate_context=True):
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        try:
            return predict(questions, truncate_context)
        finally:
            if profile is not None:
                profile.disable()
            inside[0] += time.perf_counter() - start
            passes.append(len(questions))

    try:
        model.predict(bodies[:size], batch_size=size)  # warm-up: CUDA kernels, caches
        predictor.predict, predictor._hidden = timed_predict, timed_hidden  # counted from here on
        start = time.perf_counter()
        model.predict(bodies, batch_size=size)
        seconds = time.perf_counter() - start
        predictor.predict, predictor._hidden = predict, hidden
        questions = [model.check(b).question for b in bodies[:size]]
        operators = operator_table(lambda: model.engine.default.predict(questions), device)
    finally:
        model.close()
    counts = getattr(predictor.trunk, "counts", None)  # a graphed trunk's captures, replays and eager forwards
    return {"backend": backend, "max_batch_size": size, "max_batch_tokens": tokens, "loose": loose,
            "questions": len(bodies), "graph_counts": None if counts is None else dict(counts),
            "answers_per_s": len(bodies) / seconds, "seconds": seconds, "passes": len(passes),
            "mean_pass_questions": sum(passes) / max(len(passes), 1), "trunk_forwards": forwards[0],
            "predictor_s": inside[0],
            "trunk_forward_s": trunk[0], "engine_outside_predictor_s": seconds - inside[0],
            "predictor_outside_trunk_s": inside[0] - trunk[0], "one_pass_operators": operators}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_serve_profile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="runs/gpu_check/default-cuda")
    parser.add_argument("--questions", type=int, default=512, help="distinct questions per setting (default 512)")
    parser.add_argument("--settings", default="16:2048,64:32768,64:32768:loose,256:131072:loose",
                        help="max_batch_size:max_batch_tokens[:loose],... (default: the engine's default first)")
    parser.add_argument("--backends", default="torch-cuda-graphs-bf16,torch",
                        help="the backends to measure each setting on, in order (default: the graphed trunk, then "
                             "torch as loaded)")
    parser.add_argument("--output", default="benchmarks/results/gpu_serve_profile.json")
    args = parser.parse_args(argv)
    from ibedl.core.backends.registry import check_backend

    if args.questions < 1:
        parser.error(f"--questions must be >= 1, got {args.questions}")
    try:
        settings = parse_settings(args.settings)
        names = [check_backend(n.strip()) for n in args.backends.split(",") if n.strip()]
    except ValueError as e:
        parser.error(str(e))
    if not names or "auto" in names:
        parser.error(f"--backends: name one or more backends (auto is a choice among them), got {args.backends!r}")
    if not (Path(args.artifact) / "manifest.json").is_file():
        parser.error(f"--artifact: {args.artifact} holds no manifest.json (run make gpu-check's calibrate step)")
    import torch

    if not torch.cuda.is_available():
        print(f"error: no CUDA device (torch {torch.__version__}); this profile is for a GPU machine", file=sys.stderr)
        return 2
    from ibedl.training.data import load_dataset

    bodies = [{"question": q.question, "options": list(q.options), "context": q.context}
              for q in load_dataset("sciq", "train", limit=args.questions, seed=0)]
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "artifact": args.artifact,
              "settings": []}
    profile = cProfile.Profile()
    runs = [(name, *setting) for name in names for setting in settings]
    for i, (name, size, tokens, loose) in enumerate(runs):
        row = measure(args.artifact, bodies, size, tokens, profile if i == len(runs) - 1 else None, loose=loose,
                      backend=name)
        result["settings"].append(row)
        write_result(args.output, result, echo=False)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items() if k != "one_pass_operators"},
              {k: v for k, v in row["one_pass_operators"].items() if k != "top_by_cpu"}, flush=True)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(20)
    result["top_functions_last_setting"] = [line.rstrip() for line in text.getvalue().splitlines()
                                            if line.strip()][-22:]
    write_result(args.output, result, echo=False)
    print("\n".join(result["top_functions_last_setting"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
