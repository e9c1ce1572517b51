"""Import boundaries: the service depends on the core, never on training; the core on neither, nor on the API."""

import subprocess
import sys


def test_importing_service_does_not_import_training():
    code = (
        "import sys, ibedl.serve.app, ibedl.serve.__main__; "
        "bad = sorted(m for m in sys.modules if m == 'ibedl.training' or m.startswith('ibedl.training.') "
        "or m in ('laplace', 'ibedl.api')); "
        "print(bad); raise SystemExit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_core_does_not_import_training_engine_or_service():
    code = (
        "import sys, ibedl.core.head, ibedl.core.predictor, ibedl.core.artifact, ibedl.core.base_model; "
        "bad = sorted(m for m in sys.modules if m.split('.')[:2] in (['ibedl', 'training'], ['ibedl', 'serve'], "
        "['ibedl', 'engine']) "
        "or m in ('ibedl.api', 'ibedl.batch')); "
        "print(bad); raise SystemExit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
