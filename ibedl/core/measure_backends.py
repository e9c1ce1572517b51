"""Build and time the inference backends an artifact carries a calibration for, on this machine, ahead of serving
(what ``IBEDL_BACKEND=auto`` otherwise does in the service's background, ibedl.engine.backend_switch):

    python -m ibedl.core.measure_backends --artifact DIR              # build every candidate, time, cache the verdict
    python -m ibedl.core.measure_backends --artifact DIR --build NAME # export backend NAME's IR into the cache only

The verdict is cached in IBEDL_CACHE_DIR/backends/ (ibedl.core.auto_backend), where the service, ``evaluate`` and
the Python API read it at their next start.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from ibedl.core import auto_backend, backends
from ibedl.core.base_model import resolve_model
from ibedl.core.predictor import Predictor


def main(argv: list[str] | None = None) -> None:
    """``--artifact DIR``: build every candidate and time them (the measurement the service reads at its next start);
    ``--build NAME``: export backend NAME's IR into the cache and exit."""
    parser = argparse.ArgumentParser(prog="python -m ibedl.core.measure_backends", description=main.__doc__)
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--base-model", default=None, help="base model reference (default: the manifest's)")
    parser.add_argument("--build", default=None,
                        choices=[c for c in auto_backend.candidate_names() if c != backends.REFERENCE],
                        help="only export this backend's IR into IBEDL_CACHE_DIR/backends")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    predictor = Predictor.from_artifact(args.artifact, base_model=args.base_model, backend=backends.REFERENCE)
    sha = resolve_model(args.base_model or predictor.manifest.base_model_ref().ref).sha256
    if args.build is not None:
        try:
            print(backends.export_ir(args.build, predictor, Path(args.artifact), sha, copy_model=False))
        except ValueError as e:  # a backend with nothing to export (torch-cuda-*: the model as loaded)
            parser.error(f"--build {args.build}: {e}")
        return
    choice, _ = auto_backend.choose(predictor, Path(args.artifact), sha,
                       lambda name: backends.build_one(name, predictor, Path(args.artifact), sha),
                       backends.unavailable)
    print(json.dumps(choice.to_dict(), indent=1))


if __name__ == "__main__":
    main()
