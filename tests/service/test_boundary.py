"""Import boundaries: the service depends on the evidential core, never on training."""

import subprocess
import sys


def test_importing_service_does_not_import_training():
    code = (
        "import sys, service.app, service.__main__; "
        "bad = sorted(m for m in sys.modules if m == 'training' or m.startswith('training.') or m == 'laplace'); "
        "print(bad); raise SystemExit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_evidential_does_not_import_training_or_service():
    code = (
        "import sys, evidential.predictor, evidential.artifact, evidential.base_model; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('training', 'service')); "
        "print(bad); raise SystemExit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
