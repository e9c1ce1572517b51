"""The GPU install on a CUDA machine that has its own torch and no package index (make gpu-wheels, make
setup-gpu-offline): which locked wheels to carry there, and the install from them.

    # where there is an index: the wheels the machine lacks, for its Python
    python requirements/offline.py wheels --have HAVE.txt [--extras train,serve,gpu] [--without openvino nncf]
        > wheels/gpu/requirements.txt
    # on the machine (its python has the CUDA torch): a venv over its packages, the carried wheels, the project
    python requirements/offline.py install --venv .venv-gpu --wheels wheels/gpu [--extras ...] [--without ...]

``wheels`` reads requirements/gpu-offline.txt (the GPU lock without torch and its CUDA runtime, hashes kept) and
keeps the entries the project needs at run time: the closure of pyproject.toml's dependencies and the named extras,
followed through the ``# via`` annotations of requirements/gpu.lock.txt (so the dev extra's tools stay behind),
minus the packages ``--without`` names (e.g. the OpenVINO backends, CPU only) and minus those the machine already
has: ``HAVE.txt`` is its ``python3 -m pip list --format=freeze``, compared by name. Those keep the machine's
versions; ``install`` ends by checking each of pyproject.toml's requirements (dependencies and the extras) against
what the venv then imports, and fails naming any that is missing or outside its range.

``install`` makes the venv with ``--system-site-packages`` and a ``.pth`` naming this python's own site-packages
(where this python is itself a venv, as on a machine whose torch lives in one, ``--system-site-packages`` reaches
only its base), installs the listed wheels with ``--no-index --require-hashes --no-deps`` through this python's pip
(``pip --python``: the venv needs none of its own), then the project itself, editable. Standard library only but
for the range check, which uses ``packaging`` where the venv has it (pip's vendored copy otherwise).
"""

from __future__ import annotations

import argparse
import re
import site
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = ROOT / "requirements/gpu-offline.txt"
GRAPH = ROOT / "requirements/gpu.lock.txt"
DEFAULT_EXTRAS = ("train", "serve", "gpu")
GPU_IN = "gpu.in"  # the root standing for requirements/gpu.in in via()
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    """PEP 503's normal form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def entries(text: str) -> dict[str, str]:
    """A hashed requirements file -> {canonical name: its entry, continuation lines included}; comments dropped."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if line[0].isspace():
            if current is None:
                raise ValueError(f"a continuation line before any entry: {line!r}")
            out[current].append(line)
            continue
        current = canonical(_NAME.match(line).group(1))
        out[current] = [line]
    return {name: "\n".join(lines) + "\n" for name, lines in out.items()}


def via(text: str) -> dict[str, set[str]]:
    """uv's annotated lock -> {canonical name: the canonical names it is there for}: ``ibedl`` where pyproject.toml
    names it (``# via ibedl (pyproject.toml)``), ``gpu.in`` where requirements/gpu.in does (the default model's
    package, the Laplace baseline's), constraint files dropped."""
    parents: dict[str, set[str]] = {}
    current, in_via = None, False
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            current, in_via = canonical(_NAME.match(line).group(1)), False
            parents[current] = set()
            continue
        stripped = line.strip()
        if current is None or not stripped.startswith("#"):
            continue
        body = stripped.lstrip("#").strip()
        if body.startswith("via"):
            in_via, body = True, body[3:].strip()
        if in_via and body.startswith("-r ") and body.endswith("gpu.in"):
            parents[current].add(GPU_IN)
        elif in_via and body and not body.startswith("-"):
            parents[current].add(canonical(body.split()[0]))
    return parents


def requirement_names(pyproject: dict, extras: list[str]) -> list[tuple[str, str]]:
    """(canonical name, requirement text) of ``[project] dependencies`` and the named extras; ValueError naming an
    extra pyproject.toml lacks."""
    known = pyproject["project"]["optional-dependencies"]
    unknown = sorted(set(extras) - set(known))
    if unknown:
        raise ValueError(f"unknown extras {unknown}; pyproject.toml has {sorted(known)}")
    texts = list(pyproject["project"]["dependencies"]) + [t for e in extras for t in known[e]]
    return [(canonical(_NAME.match(t).group(1)), t) for t in texts]


def runtime_closure(roots: set[str], parents: dict[str, set[str]]) -> set[str]:
    """The locked packages reachable from ``roots``: each root, and each package one of whose parents is in."""
    needed = set(roots)
    changed = True
    while changed:
        changed = False
        for name, there_for in parents.items():
            if name not in needed and there_for & needed:
                needed.add(name)
                changed = True
    return needed


def have_names(text: str) -> set[str]:
    """``pip list --format=freeze`` (or ``pip freeze``) output -> the canonical names installed."""
    return {canonical(m.group(1)) for line in text.splitlines() if (m := _NAME.match(line)) and "==" in line}


def wheels_to_carry(offline: str, graph: str, pyproject: dict, extras: list[str], have: set[str],
                    without: set[str]) -> str:
    """The entries of ``offline`` a machine having ``have`` must be given to run with ``extras``."""
    roots = ({name for name, _ in requirement_names(pyproject, extras)} | {GPU_IN}) - without
    needed = runtime_closure(roots, {n: p - without for n, p in via(graph).items() if n not in without})
    locked = entries(offline)
    keep = sorted((needed & set(locked)) - have - without)
    header = (f"# requirements/gpu-offline.txt's entries for extras {','.join(extras)} that the machine lacks"
              f"{' (without ' + ' '.join(sorted(without)) + ')' if without else ''}: written by make gpu-wheels\n")
    return header + "".join(locked[name] for name in keep)


def unmet(pyproject: dict, extras: list[str], without: set[str]) -> list[str]:
    """pyproject.toml's requirements (dependencies and ``extras``, less ``without``) this interpreter does not meet:
    one line each, with the installed version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        from packaging.requirements import Requirement
    except ImportError:  # the machine's python may lack it; pip always carries one
        from pip._vendor.packaging.requirements import Requirement
    problems = []
    for name, text in requirement_names(pyproject, extras):
        if name in without:
            continue
        requirement = Requirement(text)
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            problems.append(f"{text}: not installed")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            problems.append(f"{text}: {installed} is installed")
    return problems


def install(venv: Path, wheels: Path, extras: list[str], without: set[str], cpu_ok: bool = False) -> int:
    """Make ``venv`` over this python's packages, install ``wheels``' requirements.txt and the project, check it
    (``cpu_ok``: on a torch without CUDA too, as the tests do)."""
    try:
        import torch
    except ImportError:
        print(f"error: {sys.executable} has no torch: the offline install is for a python with a CUDA torch",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not cpu_ok:
        print(f"error: {sys.executable}'s torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    listed = wheels / "requirements.txt"
    if not listed.is_file():
        print(f"error: {listed} is missing: make gpu-wheels writes it beside the wheels", file=sys.stderr)
        return 2
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "machine-packages.pth").write_text("".join(p + "\n" for p in site.getsitepackages()))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", python, "install", "-q",
           "--no-index", "--no-deps"]
    if entries(listed.read_text()):
        subprocess.run([*pip, "--find-links", str(wheels), "--require-hashes", "-r", str(listed)], check=True)
    subprocess.run([*pip, "--no-build-isolation", "-e", str(ROOT)], check=True)
    check = subprocess.run([python, __file__, "check", "--extras", ",".join(extras), "--without", *sorted(without)])
    return check.returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python requirements/offline.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("wheels", "install", "check"):
        p = sub.add_parser(name)
        p.add_argument("--extras", default=",".join(DEFAULT_EXTRAS), help="pyproject.toml extras to run with")
        p.add_argument("--without", nargs="*", default=[], help="packages left out on purpose (and their own needs)")
        if name == "wheels":
            p.add_argument("--have", type=Path, help="the machine's `python3 -m pip list --format=freeze`")
        if name == "install":
            p.add_argument("--venv", type=Path, default=ROOT / ".venv-gpu")
            p.add_argument("--wheels", type=Path, default=ROOT / "wheels/gpu")
            p.add_argument("--cpu-ok", action="store_true", help="install beside a torch without CUDA (tests)")
    args = parser.parse_args(argv)
    extras = [e for e in args.extras.split(",") if e]
    without = {canonical(n) for n in args.without}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    try:
        requirement_names(pyproject, extras)
    except ValueError as e:
        parser.error(str(e))
    if args.command == "wheels":
        if args.have is not None and not args.have.is_file():
            parser.error(f"--have: no file {args.have}")
        have = have_names(args.have.read_text()) if args.have else set()
        sys.stdout.write(wheels_to_carry(OFFLINE.read_text(), GRAPH.read_text(), pyproject, extras, have, without))
        return 0
    if args.command == "install":
        return install(args.venv, args.wheels, extras, without, args.cpu_ok)
    problems = unmet(pyproject, extras, without)
    for line in problems:
        print(f"unmet: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
