"""Copy the numbers of finished training runs into one JSON file, from their own manifests and histories.

    python -m benchmarks.collect_runs OUTPUT.json RUN_DIR [RUN_DIR ...] [--note TEXT]

Each RUN_DIR is a finetune output (``manifest.json`` + ``history.jsonl``), named in OUTPUT by its
directory name. An entry of OUTPUT with the same name is replaced, others are kept, so runs of several sessions
accumulate in one file. The adapters themselves are not needed afterwards; the entry keeps the exact command that
made them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def ceiling_for_old_manifest(method: str, manifest: dict) -> dict | None:
    """Manifests written before training recorded the ceiling: recompute it (4 options, as in SciQ/ARC/OBQA)."""
    from ibedl.training.methods import get_method

    record = get_method(method)
    if record.confidence_ceiling is None:
        return None
    return record.confidence_ceiling({**record.defaults, **manifest.get("method_config", {})}, 4)


COLLAPSED_U = 0.9  # a batch whose mean uncertainty mass is above this has (almost) no evidence on any option


def training_windows(records: list[dict], width: int = 50) -> list[dict]:
    """Per ``width`` training steps: mean batch accuracy and grad norm, and for evidential runs the share of
    steps whose batch-mean u exceeds COLLAPSED_U (every option's evidence near 0, softplus's flat side,
    where the risk's gradient vanishes)."""
    windows: dict[int, list[dict]] = {}
    for record in records:
        if "batch_accuracy" in record:
            windows.setdefault((record["step"] - 1) // width, []).append(record)
    out = []
    for index in sorted(windows):
        rows = windows[index]
        window = {"steps": [index * width + 1, (index + 1) * width], "logged": len(rows),
                  "batch_accuracy": sum(r["batch_accuracy"] for r in rows) / len(rows),
                  "grad_norm": sum(r.get("grad_norm", 0.0) for r in rows) / len(rows)}
        with_u = [r["uncertainty"] for r in rows if r.get("uncertainty") is not None]
        if with_u:
            window["collapsed_fraction"] = sum(u > COLLAPSED_U for u in with_u) / len(with_u)
        out.append(window)
    return out


def run_entry(run_dir: Path) -> dict:
    """One run's command, method settings, validation curve and final metrics."""
    manifest_path, history_path = run_dir / "manifest.json", run_dir / "history.jsonl"
    for path in (manifest_path, history_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: is {run_dir} a finished training run?")
    manifest = json.loads(manifest_path.read_text())
    try:
        training, metrics, method = manifest["training"], manifest["metrics"], manifest["method"]
        command, run = training["command"], training["run"]
    except KeyError as e:
        raise ValueError(f"{manifest_path}: no {e} entry; not a training manifest") from None
    curve, records = [], []
    for number, line in enumerate(history_path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{history_path}:{number}: not JSON ({e})") from e
        records.append(record)
        if "validation" in record:
            curve.append({"step": record["step"], **record["validation"]})
    return {
        "name": run_dir.resolve().name,
        "method": method,
        "command": command,
        "method_config": manifest.get("method_config", {}),
        "confidence_ceiling": training.get("confidence_ceiling") or ceiling_for_old_manifest(method, manifest),
        "train_seconds": run["seconds"],
        "steps": run["steps"],
        "validation_during_training": curve,
        "training_windows": training_windows(records),
        "metrics": metrics,
        "zeta": training.get("zeta"),
    }


def collect(output: Path, run_dirs: list[Path], note: str | None = None) -> dict:
    """Add or replace the entries of ``run_dirs`` in ``output`` (created if missing) and write it."""
    data = json.loads(output.read_text()) if output.is_file() else {"note": "", "runs": []}
    if note:
        data["note"] = note
    for run_dir in run_dirs:
        entry = run_entry(run_dir)
        data["runs"] = [r for r in data["runs"] if r["name"] != entry["name"]] + [entry]
    output.write_text(json.dumps(data, indent=1) + "\n")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--note")
    args = parser.parse_args(argv)
    try:
        data = collect(args.output, args.runs, args.note)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e!s}", file=sys.stderr)
        return 2
    for r in data["runs"]:
        test = r["metrics"].get("test", {})
        print(f"{r['name']:28s} acc {test.get('accuracy', float('nan')):.3f}  ece {test.get('ece', float('nan')):.3f}"
              f"  nll {test.get('nll', float('nan')):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
