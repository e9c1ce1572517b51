"""The GPU install on a CUDA machine that has its own torch and no package index (make gpu-wheels, make
setup-gpu-offline): which locked wheels to carry there, and the install from them.

    # where there is an index: the wheels the machine lacks, for its Python
    python requirements/offline.py wheels --have HAVE.txt [--without openvino nncf] > wheels/gpu/requirements.txt
    # once the wheels are downloaded: also the pool's own version of a machine package a carried wheel refuses
    python requirements/offline.py wheels --have HAVE.txt --wheels-dir wheels/gpu --python-version 3.12 [...] > ...
    # on the machine (its python has the CUDA torch): a venv over its packages, the carried wheels, the project
    python requirements/offline.py install --venv .venv-gpu --wheels wheels/gpu [--without ...]

``wheels`` picks from requirements/gpu-offline.txt: what the project needs at run time on a CUDA machine
(pyproject.toml's dependencies, the train, serve and gpu extras, requirements/gpu.in), resolved by ``make lock`` at
requirements/gpu.lock.txt's versions, without torch and its CUDA runtime, hashes and ``# via`` annotations kept. It
leaves out what ``--without`` names (e.g. the OpenVINO backends, CPU only) with what is there only for it (followed
through the annotations), and what the machine already has: ``HAVE.txt`` is its ``python3 -m pip list
--format=freeze``. A package the machine has is kept at the machine's version unless pyproject.toml (its
requirements, or its build system's, for the editable install) excludes that version, or (with ``--wheels-dir``, the
wheels already downloaded) a carried wheel's own requirements do (tritonclient 2.73 asks for ml-dtypes <= 0.5.4, a
machine with JAX has 0.6): then the lock's is carried, installed in the venv in front of the machine's.

``install`` checks the python it runs on (a CUDA torch, pip >= 22.3 for ``pip --python``), makes the venv with
``--system-site-packages`` and a ``.pth`` adding this python's own site-packages as site directories (where this
python is itself a venv, as on a machine whose torch lives in one, ``--system-site-packages`` reaches only its base;
``site.addsitedir`` also runs the ``.pth`` files there), installs the carried wheels with ``--no-index
--require-hashes --no-deps`` through this python's pip, then the project itself, editable, and ends by checking each
of pyproject.toml's requirements (the dependencies and the extras, less ``--without``) against what the venv then
imports, and ``pip check``'s complaints about the pool's packages (a machine package older than a carried one needs;
a need the pool lacks on another Python than the lock's 3.11), failing with the ones missing or outside their
range. Standard library only, but for the ranges: ``packaging`` where the python has it, pip's vendored copy
otherwise.
"""

from __future__ import annotations

import argparse
import re
import site
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (pyproject.toml allows it): pip vendors tomli
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = ROOT / "requirements/gpu-offline.txt"
EXTRAS = ("train", "serve", "gpu")  # what requirements/gpu-offline.txt is resolved for (make lock)
ROOTS = ("ibedl", "gpu.in")  # what a pool entry is there for when pyproject.toml or requirements/gpu.in names it
PIP_WITH_PYTHON = (22, 3)  # pip --python
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _packaging():
    """(Requirement, Version) from ``packaging``, or from pip's vendored copy on a python without it."""
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.version import Version
    return Requirement, Version


def canonical(name: str) -> str:
    """PEP 503's normal form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _entry_name(line: str, number: int) -> str:
    match = _NAME.match(line)
    if line.startswith("-") or match is None:
        raise ValueError(f"line {number}: not a name==version entry: {line!r}")
    return canonical(match.group(1))


def entries(text: str) -> dict[str, str]:
    """A hashed requirements file -> {canonical name: its entry with its continuation lines}; comments dropped.
    ValueError naming a line that is neither an entry, a continuation nor a comment (an option such as
    ``--index-url``), or a name listed twice. The one parser of such files (tests/test_lock.py reads the locks
    with it)."""
    out: dict[str, list[str]] = {}
    current = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if line[0].isspace():
            if current is None:
                raise ValueError(f"line {number}: a continuation line before any entry: {line!r}")
            out[current].append(line)
            continue
        current = _entry_name(line, number)
        if current in out:
            raise ValueError(f"line {number}: {current} is listed twice")
        out[current] = [line]
    return {name: "\n".join(lines) + "\n" for name, lines in out.items()}


def via(text: str) -> dict[str, set[str]]:
    """uv's annotated lock -> {canonical name: what it is there for}: other packages' canonical names, ``ibedl``
    where pyproject.toml names it (``# via ibedl (pyproject.toml)``), ``gpu.in`` where requirements/gpu.in does;
    constraint files dropped."""
    parents: dict[str, set[str]] = {}
    current, in_via = None, False
    for number, line in enumerate(text.splitlines(), 1):
        if line and not line[0].isspace() and not line.startswith("#"):
            current, in_via = _entry_name(line, number), False
            parents[current] = set()
            continue
        stripped = line.strip()
        if current is None or not stripped.startswith("#"):
            continue
        body = stripped.lstrip("#").strip()
        if body.startswith("via"):
            in_via, body = True, body[3:].strip()
        if in_via and body.startswith("-r ") and body.endswith("gpu.in"):
            parents[current].add("gpu.in")
        elif in_via and body and not body.startswith("-"):
            parents[current].add(canonical(body.split()[0]))
    return parents


def needed(parents: dict[str, set[str]], without: set[str], also: set[str] = frozenset()) -> set[str]:
    """The entries still needed once ``without`` is left out: those the roots (:data:`ROOTS`) ask for, those named
    in ``also`` (the build system's, for the editable install), and those asked for by one needed (an entry there
    only for a left-out one goes with it)."""
    keep = ({name for name, there_for in parents.items() if there_for & set(ROOTS)} | (set(also) & set(parents))
            ) - without
    changed = True
    while changed:
        changed = False
        for name, there_for in parents.items():
            if name not in keep and name not in without and there_for & keep:
                keep.add(name)
                changed = True
    return keep


def requirement_texts(pyproject: dict, extras) -> list[str]:
    """The requirement strings of ``[project] dependencies`` and the named extras; ValueError naming an extra
    pyproject.toml lacks."""
    known = pyproject["project"]["optional-dependencies"]
    unknown = sorted(set(extras) - set(known))
    if unknown:
        raise ValueError(f"unknown extras {unknown}; pyproject.toml has {sorted(known)}")
    return list(pyproject["project"]["dependencies"]) + [t for e in extras for t in known[e]]


def have_versions(text: str) -> dict[str, str | None]:
    """``pip list --format=freeze`` (or ``pip freeze``) output -> {canonical name: version, None for ``name @ url``}."""
    found: dict[str, str | None] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-")):
            continue
        if "==" in line:
            name, _, version = line.partition("==")
            found[canonical(name.strip())] = version.strip()
        elif " @ " in line:
            found[canonical(line.partition(" @ ")[0].strip())] = None
    return found


def acceptable(have: dict[str, str | None], pyproject: dict) -> set[str]:
    """The names of ``have`` whose version pyproject.toml allows: its requirements (dependencies and every extra the
    pool is resolved for) and its build system's; a package none of them names is acceptable at any version."""
    Requirement, Version = _packaging()
    ranges: dict[str, list] = {}
    for text in requirement_texts(pyproject, EXTRAS) + list(pyproject["build-system"]["requires"]):
        requirement = Requirement(text)
        ranges.setdefault(canonical(requirement.name), []).append(requirement.specifier)
    ok = set()
    for name, version in have.items():
        if version is None or name not in ranges:
            ok.add(name)
            continue
        try:
            parsed = Version(version)
        except ValueError:  # InvalidVersion: not a version pyproject's ranges can admit
            continue
        if all(spec.contains(parsed, prereleases=True) for spec in ranges[name]):
            ok.add(name)
    return ok


def pinned_version(entry: str) -> str:
    """The version an :func:`entries` entry pins (``name==version \\`` on its first line)."""
    return entry.split("==", 1)[1].split()[0].rstrip("\\")


def wheel_requirements(path: Path) -> tuple[str, str, list[str]]:
    """A wheel file -> (its canonical name, its version, its ``Requires-Dist`` strings), read from its METADATA;
    ValueError for a file that is not a wheel."""
    import email.parser
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if len(names) != 1:
                raise ValueError(f"{path.name}: not a wheel (no single .dist-info/METADATA)")
            meta = email.parser.Parser().parsestr(z.read(names[0]).decode())
    except zipfile.BadZipFile:
        raise ValueError(f"{path.name}: not a wheel (not a zip file)") from None
    return canonical(meta["Name"]), meta["Version"], list(meta.get_all("Requires-Dist") or [])


def refused_by_carried(wheels: list[Path], have: dict[str, str | None], carried: set[str], pyproject: dict,
                       python_version: str) -> dict[str, str]:
    """The machine's packages (in ``have``, not ``carried``) at a version one of ``wheels`` requires otherwise, on
    Python ``python_version`` (its unconditional requirements and those of the extras pyproject.toml asks of it,
    e.g. tritonclient[grpc]) -> why, e.g. ``tritonclient requires ml-dtypes<=0.5.4; the machine has 0.6.0``. A
    machine package without a version (``name @ url``) is not judged."""
    Requirement, Version = _packaging()
    asked: dict[str, set[str]] = {}
    for text in requirement_texts(pyproject, EXTRAS):
        requirement = Requirement(text)
        asked.setdefault(canonical(requirement.name), set()).update(requirement.extras)
    env = {"python_version": python_version, "python_full_version": f"{python_version}.0"}
    refused: dict[str, str] = {}
    for path in wheels:
        name, _, texts = wheel_requirements(path)
        for text in texts:
            requirement = Requirement(text)
            dep = canonical(requirement.name)
            if dep in carried or have.get(dep) is None or dep in refused:
                continue
            if requirement.marker and not any(requirement.marker.evaluate({**env, "extra": extra})
                                              for extra in ["", *sorted(asked.get(name, ()))]):
                continue
            try:
                ok = requirement.specifier.contains(Version(have[dep]), prereleases=True)
            except ValueError:  # InvalidVersion
                ok = False
            if not ok:
                refused[dep] = f"{name} requires {requirement.name}{requirement.specifier}; the machine has {have[dep]}"
    return refused


def wheels_to_carry(pool: str, pyproject: dict, have: dict[str, str | None], without: set[str],
                    wheels_dir: Path | None = None, python_version: str = "3.11") -> str:
    """The entries of ``pool`` (requirements/gpu-offline.txt) a machine having ``have`` must be given; with
    ``wheels_dir`` (the wheels downloaded for the previous answer), also the pool's version of each machine package
    a carried wheel there (at the lock's version: another version left there is not read) refuses on Python
    ``python_version`` (:func:`refused_by_carried`); each such package is named in a comment, and one the pool
    lacks too (the install's pip check will name it). A package added so has no wheel there yet: its own
    requirements are read on the next call, so ``make gpu-wheels`` repeats download and call until the answer
    stops changing. ValueError naming a ``without`` the pool does not hold."""
    parents, locked = via(pool), entries(pool)
    unknown = sorted(without - set(locked))
    if unknown:
        raise ValueError(f"--without: {unknown} are not in {OFFLINE.name}")
    Requirement, _ = _packaging()
    build = {canonical(Requirement(t).name) for t in pyproject["build-system"]["requires"]}
    keep = needed(parents, without, build) - acceptable(have, pyproject)
    refused: dict[str, str] = {}
    if wheels_dir is not None:
        files = {}
        for path in sorted(wheels_dir.glob("*.whl")):
            name, version, _ = wheel_requirements(path)
            if name in locked and pinned_version(locked[name]) == version:
                files[name] = path
        while True:
            found = refused_by_carried([files[n] for n in sorted(keep) if n in files], have, keep, pyproject,
                                       python_version)
            new = {n for n in found if n in locked} - keep
            refused.update(found)
            if not new:
                break
            keep |= new
    notes = [f"# {'carried although the machine has it' if n in locked else 'not in the pool'}: {why}\n"
             for n, why in sorted(refused.items())]
    header = ("# requirements/gpu-offline.txt's entries the machine lacks"
              f"{' (without ' + ' '.join(sorted(without)) + ')' if without else ''}: written by make gpu-wheels\n")
    return header + "".join(notes) + "".join(locked[name] for name in sorted(keep))


def unmet(pyproject: dict, extras, without: set[str]) -> list[str]:
    """pyproject.toml's requirements (dependencies and ``extras``, less ``without``) this interpreter does not meet,
    one line each with the installed version; a requirement whose marker excludes this interpreter is skipped (the
    extras a requirement names, e.g. psycopg[binary], are not checked)."""
    from importlib.metadata import PackageNotFoundError, version

    Requirement, _ = _packaging()
    problems = []
    for text in requirement_texts(pyproject, extras):
        requirement = Requirement(text)
        if canonical(requirement.name) in without or (requirement.marker and not requirement.marker.evaluate()):
            continue
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            problems.append(f"{text}: not installed")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            problems.append(f"{text}: {installed} is installed")
    return problems


def site_lines(directories) -> str:
    """A ``.pth`` adding ``directories`` as site directories: on the path, their own ``.pth`` files run (a plain
    path line would add the directory alone)."""
    return "".join(f"import site, sys; {str(d)!r} in sys.path or site.addsitedir({str(d)!r})\n"
                   for d in directories)


def pip_version() -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int(p) for p in re.findall(r"\d+", version("pip"))[:2])


def install(venv: Path, wheels: Path, without: set[str], cpu_ok: bool = False) -> int:
    """Make ``venv`` over this python's packages, install ``wheels``' requirements.txt and the project, check it
    (``cpu_ok``: beside a torch without CUDA too, as the tests do)."""
    try:
        import torch
    except ImportError:
        print(f"error: {sys.executable} has no torch: the offline install is for a python with a CUDA torch",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not cpu_ok:
        print(f"error: {sys.executable}'s torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    pip_now = pip_version()
    if pip_now < PIP_WITH_PYTHON:
        print(f"error: {sys.executable}'s pip is {'.'.join(map(str, pip_now))}; the offline install needs "
              f"pip >= {'.'.join(map(str, PIP_WITH_PYTHON))} (pip --python): carry a newer pip wheel and install it "
              "with --no-index first", file=sys.stderr)
        return 2
    listed = wheels / "requirements.txt"
    if not listed.is_file():
        print(f"error: {listed} is missing: make gpu-wheels writes it beside the wheels", file=sys.stderr)
        return 2
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "machine-packages.pth").write_text(site_lines(site.getsitepackages()))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", python, "install", "-q",
           "--no-index", "--no-deps"]
    if entries(listed.read_text()):
        subprocess.run([*pip, "--find-links", str(wheels), "--require-hashes", "-r", str(listed)], check=True)
    subprocess.run([*pip, "--no-build-isolation", "-e", str(ROOT)], check=True)
    broken = pip_check_problems(python, set(entries(OFFLINE.read_text())) | {"ibedl"})
    for line in broken:
        print(f"pip check: {line}", file=sys.stderr)
    ranges = subprocess.run([python, __file__, "check", "--without", *sorted(without)]).returncode
    return ranges or (1 if broken else 0)


def dropped_on_purpose() -> set[str]:
    """Declared dependencies the lock drops (requirements/overrides.txt: llm, llama-cpp-python, torchvision)."""
    text = (ROOT / "requirements/overrides.txt").read_text()
    return {canonical(m.group(1)) for line in text.splitlines() if (m := _NAME.match(line)) and
            not line.lstrip().startswith("#")}


def pip_check_problems(python: str, ours: set[str]) -> list[str]:
    """``pip check``'s lines in ``python``'s environment about the packages in ``ours`` (the pool's and the
    project): a machine package at a version the carried ones do not accept (a tokenizers older than the carried
    transformers needs), or a need the pool lacks on this Python (it is resolved for the lock's 3.11). Lines about
    the machine's other packages, and the dependencies dropped on purpose, are not ours to judge."""
    out = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", python, "check"],
                         capture_output=True, text=True).stdout
    return ours_of(out, ours, dropped_on_purpose())


def ours_of(pip_check: str, ours: set[str], dropped: set[str]) -> list[str]:
    """The lines of ``pip check`` output whose package is in ``ours``, less those requiring a ``dropped`` one."""
    problems = []
    for line in pip_check.splitlines():
        words = line.split()
        if not words or canonical(words[0]) not in ours:
            continue
        if " requires " in line and canonical(line.split(" requires ")[1].split(",")[0].split()[0]) in dropped:
            continue
        problems.append(line)
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python requirements/offline.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("wheels", "install", "check"):
        p = sub.add_parser(name)
        p.add_argument("--without", nargs="*", default=[], help="packages left out on purpose (and their own needs)")
        if name == "wheels":
            p.add_argument("--have", type=Path, help="the machine's `python3 -m pip list --format=freeze`")
            p.add_argument("--wheels-dir", type=Path, help="the wheels already downloaded: also carry the pool's "
                           "version of a machine package one of them refuses")
            p.add_argument("--python-version", default="3.11", help="the machine's Python (default 3.11)")
        if name == "install":
            p.add_argument("--venv", type=Path, default=ROOT / ".venv-gpu")
            p.add_argument("--wheels", type=Path, default=ROOT / "wheels/gpu")
            p.add_argument("--cpu-ok", action="store_true", help="install beside a torch without CUDA (tests)")
        if name == "check":
            p.add_argument("--extras", default=",".join(EXTRAS), help="pyproject.toml extras to check")
    args = parser.parse_args(argv)
    without = {canonical(n) for n in args.without}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    if args.command == "wheels":
        if args.have is not None and not args.have.is_file():
            parser.error(f"--have: no file {args.have}")
        if args.wheels_dir is not None and not args.wheels_dir.is_dir():
            parser.error(f"--wheels-dir: no directory {args.wheels_dir}")
        if not re.fullmatch(r"3\.\d+", args.python_version):
            parser.error(f"--python-version: expected 3.N, got {args.python_version!r}")
        have = have_versions(args.have.read_text()) if args.have else {}
        try:
            sys.stdout.write(wheels_to_carry(OFFLINE.read_text(), pyproject, have, without, args.wheels_dir,
                                             args.python_version))
        except ValueError as e:
            parser.error(str(e))
        return 0
    if args.command == "install":
        return install(args.venv, args.wheels, without, args.cpu_ok)
    try:
        problems = unmet(pyproject, [e for e in args.extras.split(",") if e], without)
    except ValueError as e:
        parser.error(str(e))
    for line in problems:
        print(f"unmet: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
