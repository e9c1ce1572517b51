"""A folder carried to a lent GPU machine in parts, when one call cannot carry it whole (make gpu-carry).

    # here: the folder as a tar split into parts that fit beside the working tree in one call each
    python requirements/carry.py split --source wheels/gpu --out .device-carry/gpu [--budget-mib 64]
    # there, once every part has arrived: each part and the whole checked by sha256, then unpacked
    python3 requirements/carry.py join --parts .device-carry/gpu --target wheels
    export IBEDL_DATA_DIR=$PWD/wheels/gpu/ibedl-data   # the datasets split carried (--datasets)

A lent machine receives the working tree (tracked files and untracked ones git does not ignore) and the ignored paths
a call names, at most ``--budget-mib`` MiB in all per call, and keeps the ignored paths from earlier calls while it
stays warm. The offline GPU install's wheels (``make gpu-wheels``: the base model's package alone is 94 MiB) do not
fit beside the tree (about 50 MiB) in one call, so ``split`` writes the folder as an uncompressed tar in parts of at
most the room one call leaves (the budget less the tree's size and ``--margin-mib``) into ``--out``, which git
ignores, with ``SHA256SUMS`` (each part's and the whole tar's sha256), and prints which paths each call carries (the
last one also carries ``SHA256SUMS``). ``--datasets sciq obqa`` adds those folders of ``--data-dir``
(IBEDL_DATA_DIR; the machine has none of the data, and every GPU run reads SciQ, the 8B-shaped one OBQA) gzipped,
about 3 of their 14 MiB, under ``<folder>/ibedl-data/``, which ``join`` unpacks plain. ``join`` refuses a missing
or altered part by name, checks the whole, and unpacks it into ``--target`` (the tar holds the folder's own name:
``wheels/gpu``). Standard library only: it runs on the machine's own python.

    # here, before split: what the GPU runs do not read stays behind (git's index and info/exclude; nothing on disk)
    python requirements/carry.py slim [--leave benchmarks/results artifacts/map-twin docs]
    # here, once the calls are done (commits are refused until then)
    python requirements/carry.py restore

``slim`` shrinks what each call sends with it (the tree: 50 MiB of which :data:`LEAVE` is 27), so the parts are
larger and fewer: for the H200's wheels 3 calls instead of 9. It removes the paths from git's index, not from the
disk, ignores them in ``.git/info/exclude`` (what a lent machine's copy honours) and installs a pre-commit hook that
refuses commits while the index lacks them; ``restore`` puts the index back from HEAD and removes both.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

MIB = 2**20
SUMS = "SHA256SUMS"
WHOLE = "whole.tar"  # the name SHA256SUMS gives the concatenated parts
DATA = "ibedl-data"  # the carried datasets' folder inside the carried one: IBEDL_DATA_DIR there
# What a lent GPU machine's runs do not read (make gpu-check-offline, make gpu-profiles, the CUDA tests): the committed
# results (those runs write theirs there; benchmarks.common.write_result makes the folder), the default's MAP twin
# (the CPU's A/B and switching tests) and the documentation site. The runs do read artifacts/default and artifacts/map
# (the check's training starts from it).
LEAVE = ("benchmarks/results", "artifacts/map-twin", "docs")
SLIM_BEGIN = "# requirements/carry.py slim: begin (python requirements/carry.py restore removes this block)"
SLIM_END = "# requirements/carry.py slim: end"
HOOK = ("#!/bin/sh\n# requirements/carry.py slim\n"
        "echo 'error: the tree is slim for calls to a lent machine (requirements/carry.py slim): git index lacks the "
        "paths it left behind; run make gpu-carry-restore before committing' >&2\nexit 1\n")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree_bytes(repo: Path) -> int:
    """Bytes of what a call sends of the working tree: tracked files and untracked ones git does not ignore."""
    out = git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    files = (repo / name for name in out.split("\0") if name)
    return sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())


def git(repo: Path, *args: str) -> str:
    """``git -C repo args``' output; ValueError with git's own message when it fails."""
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"git {' '.join(args[:2])} in {repo}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout


def git_path(repo: Path, name: str) -> Path:
    """``name`` inside the checkout's git directory (``info/exclude``, ``hooks/pre-commit``)."""
    path = Path(git(repo, "rev-parse", "--git-path", name).strip())
    return path if path.is_absolute() else repo / path


def slim_paths(repo: Path) -> list[str] | None:
    """The paths a slim tree left behind (its block in info/exclude), or None when the tree is whole."""
    exclude = git_path(repo, "info/exclude")
    lines = exclude.read_text().splitlines() if exclude.is_file() else []
    if SLIM_BEGIN not in lines:
        return None
    block = lines[lines.index(SLIM_BEGIN) + 1:]
    if SLIM_END not in block:
        raise ValueError(f"{exclude}: the slim block has no end line ({SLIM_END!r}): mend it by hand")
    return [line.lstrip("/") for line in block[:block.index(SLIM_END)]]


def slim(repo: Path, leave: tuple[str, ...] | list[str] = LEAVE) -> list[str]:
    """Leave ``leave`` out of what a call sends: removed from git's index (the files stay on disk), ignored in
    info/exclude, and commits refused by a pre-commit hook until :func:`restore`. The tracked files left behind;
    none when the tree is already slim by the same paths. ValueError, before changing anything, for a path git does
    not track, staged changes under one, a pre-commit hook of the checkout's own or one outside it (a global
    ``core.hooksPath``), a checkout with other worktrees (they share the marker and the hook, not the index), or a
    tree slim by other paths."""
    for path in leave:
        if (Path(path).is_absolute() or ".." in Path(path).parts or Path(path).as_posix().strip("/") in ("", ".")
                or any(c in path for c in "*?[]!#\\") or path != path.strip()):
            raise ValueError(f"--leave {path!r} is not a plain path inside the checkout (no globs, no '..')")
    leave = [Path(p).as_posix().strip("/") for p in leave]
    done = slim_paths(repo)
    if done is not None:
        if sorted(done) == sorted(leave):
            return []
        raise ValueError(f"the tree is already slim, leaving {done}: python requirements/carry.py restore first")
    for path in leave:
        if not git(repo, "ls-files", "--", path).strip():
            raise ValueError(f"--leave {path}: git tracks nothing there")
    worktrees = [line for line in git(repo, "worktree", "list", "--porcelain").splitlines()
                 if line.startswith("worktree ")]
    if len(worktrees) > 1:
        raise ValueError(f"this checkout has {len(worktrees)} worktrees; they share info/exclude and the hooks but not "
                         "the index, so slim would reach the others: run it where there is one")
    staged = git(repo, "diff", "--cached", "--name-only", "--", *leave).split()
    if staged:
        raise ValueError(f"staged changes under what slim leaves behind ({', '.join(staged[:3])}"
                         f"{', ...' if len(staged) > 3 else ''}): commit or unstage them first (restore resets those "
                         "paths' index to HEAD)")
    hook = git_path(repo, "hooks/pre-commit")
    if hook.exists():
        raise ValueError(f"{hook} exists: slim would install its own there to refuse commits while the tree is slim")
    git_dir = Path(git(repo, "rev-parse", "--absolute-git-dir").strip())
    if not hook.resolve().is_relative_to(git_dir.resolve()):
        raise ValueError(f"git's hooks for this checkout live in {hook.parent} (core.hooksPath), outside {git_dir}: "
                         "a hook there would refuse other repositories' commits too")
    files = [f for f in git(repo, "ls-files", "-z", "--", *leave).split("\0") if f]
    # the marker and the hook first: should the index change fail, restore still finds what to undo
    exclude = git_path(repo, "info/exclude")
    exclude.parent.mkdir(parents=True, exist_ok=True)
    old = exclude.read_text() if exclude.is_file() else ""
    block = [SLIM_BEGIN, *(f"/{p}" for p in leave), SLIM_END]
    exclude.write_text(old + ("" if not old or old.endswith("\n") else "\n") + "\n".join(block) + "\n")
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.write_text(HOOK)
    hook.chmod(0o755)
    git(repo, "rm", "-r", "-q", "--cached", "--", *leave)
    return files


def restore(repo: Path) -> list[str]:
    """Undo :func:`slim`: the index of the paths it left behind back from HEAD (the files on disk untouched), its
    info/exclude block and its pre-commit hook removed. The paths restored; none when the tree is whole. ValueError,
    changing nothing, when HEAD no longer holds one of them (a commit made past the hook dropped it)."""
    leave = slim_paths(repo)
    if leave is None:
        return []
    gone = [p for p in leave if not git(repo, "ls-tree", "-r", "--name-only", "HEAD", "--", p).strip()]
    if gone:
        raise ValueError(f"HEAD holds nothing under {', '.join(gone)}: a commit dropped them (git log --diff-filter=D "
                         f"-- {gone[0]}); bring them back there first, then restore")
    git(repo, "reset", "-q", "--", *leave)
    exclude = git_path(repo, "info/exclude")
    lines = exclude.read_text().splitlines()
    start = lines.index(SLIM_BEGIN)
    end = lines.index(SLIM_END, start)
    kept = lines[:start] + lines[end + 1:]
    exclude.write_text("\n".join(kept) + ("\n" if kept else ""))
    hook = git_path(repo, "hooks/pre-commit")
    if hook.is_file() and hook.read_text() == HOOK:
        hook.unlink()
    return leave


def tar_of(source: Path, data_dir: Path | None = None, datasets: tuple[str, ...] = ()) -> bytes:
    """``source`` as an uncompressed tar whose members are under its own name, in sorted order; then each of
    ``datasets`` (a folder of ``data_dir``) gzipped, file by file, under ``<source name>/ibedl-data/<dataset>/``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT, dereference=True) as tar:
        for path in sorted(source.rglob("*")):
            if path.is_file():
                tar.add(path, arcname=str(Path(source.name) / path.relative_to(source)), recursive=False)
        for name in datasets:
            folder = data_dir / name
            files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
            if not files:
                raise ValueError(f"dataset {name!r}: {folder} holds no files (set IBEDL_DATA_DIR or --data-dir)")
            for path in files:
                packed = gzip.compress(path.read_bytes(), mtime=0)
                info = tarfile.TarInfo(str(Path(source.name) / DATA / name / path.relative_to(folder)) + ".gz")
                info.size, info.mode = len(packed), 0o644
                tar.addfile(info, io.BytesIO(packed))
    return buffer.getvalue()


def split(source: Path, out: Path, part_bytes: int, data_dir: Path | None = None,
          datasets: tuple[str, ...] = ()) -> list[Path]:
    """Write ``source`` (and ``datasets`` of ``data_dir``: :func:`tar_of`) as a tar in parts of at most
    ``part_bytes`` into ``out`` (emptied first), with SHA256SUMS; the parts, in order."""
    if part_bytes < 1:
        raise ValueError(f"no room for a part: {part_bytes} bytes a call (lower the margin, or carry less)")
    if not source.is_dir() or not any(p.is_file() for p in source.rglob("*")):
        raise ValueError(f"{source} holds no files to carry")
    data = tar_of(source, data_dir, datasets)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if old.name.startswith("part-") or old.name == SUMS:
            old.unlink()
    count = -(-len(data) // part_bytes)
    width = max(2, len(str(count - 1)))
    parts, sums = [], []
    for i in range(count):
        chunk = data[i * part_bytes:(i + 1) * part_bytes]
        part = out / f"part-{i:0{width}d}"
        part.write_bytes(chunk)
        parts.append(part)
        sums.append(f"{sha256(chunk)}  {part.name}")
    sums.append(f"{sha256(data)}  {WHOLE}")
    (out / SUMS).write_text("\n".join(sums) + "\n")
    return parts


def read_sums(parts_dir: Path) -> dict[str, str]:
    """{file name: sha256} from ``parts_dir``'s SHA256SUMS; ValueError when it is missing or a line is not
    ``<sha256>  <name>``."""
    sums_file = parts_dir / SUMS
    if not sums_file.is_file():
        raise ValueError(f"{sums_file} is missing: it comes with the last part")
    sums = {}
    for number, line in enumerate(sums_file.read_text().splitlines(), 1):
        fields = line.split()
        if not line.strip():
            continue
        if len(fields) != 2 or len(fields[0]) != 64:
            raise ValueError(f"{sums_file} line {number} is not '<sha256>  <name>': {line!r}")
        sums[fields[1]] = fields[0]
    return sums


def join(parts_dir: Path, target: Path) -> list[str]:
    """Check every part named in ``parts_dir``'s SHA256SUMS and the whole, and unpack the tar into ``target``; the
    files unpacked (relative to ``target``). ValueError naming a missing or altered part, or an altered whole."""
    sums = read_sums(parts_dir)
    names = sorted(n for n in sums if n != WHOLE)
    missing = [n for n in names if not (parts_dir / n).is_file()]
    if missing:
        raise ValueError(f"parts not here yet: {', '.join(missing)} (carry each in a call of its own)")
    chunks = []
    for name in names:
        chunk = (parts_dir / name).read_bytes()
        if sha256(chunk) != sums[name]:
            raise ValueError(f"{name} is altered: its sha256 is not the one {SUMS} records")
        chunks.append(chunk)
    data = b"".join(chunks)
    if sha256(data) != sums.get(WHOLE):
        raise ValueError(f"the joined parts are not the tar {SUMS} records")
    if not hasattr(tarfile, "data_filter"):
        raise ValueError(f"unpacking safely needs tarfile's data filter (Python 3.11.4 or later); this is Python "
                         f"{sys.version.split()[0]}")
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        members = tar.getmembers()
        top = one_folder(members)  # checked before anything is touched
        members = [tarfile.data_filter(m, str(target)) for m in members]  # links out of target, devices refused
        staging = target / f".joining-{top}"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
        tar.extractall(staging, members=members, filter="data")
    if (target / top).is_dir() and not (target / top).is_symlink():
        shutil.rmtree(target / top)  # an earlier join's folder: replaced whole once the new one is out, no stale file
    (staging / top).rename(target / top)
    staging.rmdir()
    for packed in sorted((target / top / DATA).rglob("*.gz")):  # the datasets, plain again
        packed.with_suffix("").write_bytes(gzip.decompress(packed.read_bytes()))
        packed.unlink()
    return [m.name.removesuffix(".gz") if Path(m.name).parts[1:2] == (DATA,) else m.name for m in members
            if m.isfile()]


def one_folder(members: list) -> str:
    """The one folder every member of the tar lies in (what ``split`` writes: the source folder's name); ValueError
    naming a member that is absolute, climbs with '..', is a file beside the folder or lies in another."""
    tops = set()
    for m in members:
        parts = Path(m.name).parts
        if (len(parts) < (1 if m.isdir() else 2) or Path(m.name).is_absolute() or ".." in parts
                or parts[0] in (".", "")):
            raise ValueError(f"tar member {m.name!r} is not a path inside one folder: refused")
        tops.add(parts[0])
    if len(tops) != 1:
        raise ValueError(f"the tar holds {sorted(tops)}, not one folder: refused")
    return tops.pop()


def calls(parts: list[Path], repo: Path) -> list[list[str]]:
    """What each call carries, relative to ``repo``: one part each, the last with SHA256SUMS."""
    rel = [str(p.resolve().relative_to(repo.resolve())) for p in parts]
    out = [[r] for r in rel]
    out[-1].append(str((parts[-1].parent / SUMS).resolve().relative_to(repo.resolve())))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python requirements/carry.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="here: the folder in parts that fit one call each")
    s.add_argument("--source", default="wheels/gpu")
    s.add_argument("--out", default=".device-carry/gpu", help="where the parts go (a folder git ignores)")
    s.add_argument("--budget-mib", type=float, default=64.0, help="what one call may carry in all (default 64)")
    s.add_argument("--margin-mib", type=float, default=2.0, help="room kept free in each call (default 2)")
    s.add_argument("--repo", default=".", help="the checkout whose working tree travels with each call")
    s.add_argument("--datasets", nargs="*", default=[], help="dataset folders of --data-dir to carry too (gzipped)")
    s.add_argument("--data-dir", default=os.environ.get("IBEDL_DATA_DIR") or str(Path(__file__).resolve().parents[2]
                                                                                  / "shared" / "data"),
                   help="where the datasets are (default IBEDL_DATA_DIR, else ../shared/data beside the checkout)")
    j = sub.add_parser("join", help="there: check the parts and unpack them")
    j.add_argument("--parts", default=".device-carry/gpu")
    j.add_argument("--target", default="wheels")
    m = sub.add_parser("slim", help="here, before split: leave what the GPU runs do not read out of each call")
    m.add_argument("--leave", nargs="+", default=list(LEAVE), help=f"tracked paths (default: {' '.join(LEAVE)})")
    m.add_argument("--repo", default=".")
    r = sub.add_parser("restore", help="here, after the calls: the tree whole again")
    r.add_argument("--repo", default=".")
    args = parser.parse_args(argv)
    if args.command == "split" and (args.budget_mib <= 0 or args.margin_mib < 0):
        parser.error(f"--budget-mib must be > 0 and --margin-mib >= 0, got {args.budget_mib} and {args.margin_mib}")
    try:
        if args.command == "split":
            repo = Path(args.repo)
            if not Path(args.out).resolve().is_relative_to(repo.resolve()):
                raise ValueError(f"--out {args.out} is outside the checkout {repo}: a call carries only its paths")
            tree = tree_bytes(repo)
            room = int((args.budget_mib - args.margin_mib) * MIB) - tree
            parts = split(Path(args.source), Path(args.out), room, Path(args.data_dir), tuple(args.datasets))
            print(f"{args.source}: {sum(p.stat().st_size for p in parts) / MIB:.1f} MiB in {len(parts)} parts of at "
                  f"most {room / MIB:.1f} MiB (the working tree sends {tree / MIB:.1f} MiB with each call)")
            for i, carried in enumerate(calls(parts, repo), 1):
                print(f"call {i}: carry {carried}")
            data_at = Path(args.source) / DATA  # where join unpacks the datasets, from where the join runs
            data_at = data_at if data_at.is_absolute() else f"$PWD/{data_at}"
            print(f"then, in the last call: python3 requirements/carry.py join --parts {args.out} "
                  f"--target {Path(args.source).parent}"
                  + (f" && export IBEDL_DATA_DIR={data_at}" if args.datasets else ""))
            left = slim_paths(repo)
            if left is not None:
                print(f"the tree is slim (left behind: {' '.join(left)}); once the calls are done: "
                      "make gpu-carry-restore (commits are refused until then)")
        elif args.command == "slim":
            files = slim(Path(args.repo), args.leave)
            left = slim_paths(Path(args.repo))
            print(f"left behind: {' '.join(left)} ({len(files)} tracked files; the files stay on disk); "
                  f"each call now sends {tree_bytes(Path(args.repo)) / MIB:.1f} MiB of the tree" if files else
                  f"the tree is already slim, leaving {' '.join(left)}")
        elif args.command == "restore":
            restored = restore(Path(args.repo))
            print(f"the tree is whole again: {' '.join(restored)} back in git's index" if restored
                  else "the tree is whole: nothing to restore")
        else:
            files = join(Path(args.parts), Path(args.target))
            print(f"{len(files)} files unpacked into {args.target}")
    except (ValueError, OSError, tarfile.TarError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
