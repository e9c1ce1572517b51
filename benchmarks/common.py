"""What the benchmark scripts share: writing their results file."""

from __future__ import annotations

import json
from pathlib import Path


def write_result(path: str | Path, result, echo: bool = True) -> Path:
    """Write ``result`` as indented JSON to ``path`` (parents created) and print it unless ``echo`` is false."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2) + "\n"
    path.write_text(text)
    if echo:
        print(text, end="")
    return path
