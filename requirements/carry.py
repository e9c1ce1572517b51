"""A folder carried to a lent GPU machine in parts, when one call cannot carry it whole (make gpu-carry).

    # here: the folder as a tar split into parts that fit beside the working tree in one call each
    python requirements/carry.py split --source wheels/gpu --out .device-carry/gpu [--budget-mib 64]
    # there, once every part has arrived: each part and the whole checked by sha256, then unpacked
    python3 requirements/carry.py join --parts .device-carry/gpu --target wheels

A lent machine receives the working tree (tracked files and untracked ones git does not ignore) and the ignored paths
a call names, at most ``--budget-mib`` MiB in all per call, and keeps the ignored paths from earlier calls while it
stays warm. The offline GPU install's wheels (``make gpu-wheels``: the base model's package alone is 94 MiB) do not
fit beside the tree (about 50 MiB) in one call, so ``split`` writes the folder as an uncompressed tar in parts of at
most the room one call leaves (the budget less the tree's size and ``--margin-mib``) into ``--out``, which git
ignores, with ``SHA256SUMS`` (each part's and the whole tar's sha256), and prints which paths each call carries (the
last one also carries ``SHA256SUMS``). ``join`` refuses a missing or altered part by name, checks the whole, and
unpacks it into ``--target`` (the tar holds the folder's own name: ``wheels/gpu``). Standard library only: it runs on
the machine's own python.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

MIB = 2**20
SUMS = "SHA256SUMS"
WHOLE = "whole.tar"  # the name SHA256SUMS gives the concatenated parts


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree_bytes(repo: Path) -> int:
    """Bytes of what a call sends of the working tree: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    files = (repo / name for name in out.decode().split("\0") if name)
    return sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())


def tar_of(source: Path) -> bytes:
    """``source`` as an uncompressed tar whose members are under its own name, in sorted order."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT, dereference=True) as tar:
        for path in sorted(source.rglob("*")):
            if path.is_file():
                tar.add(path, arcname=str(Path(source.name) / path.relative_to(source)), recursive=False)
    return buffer.getvalue()


def split(source: Path, out: Path, part_bytes: int) -> list[Path]:
    """Write ``source`` as a tar in parts of at most ``part_bytes`` into ``out`` (emptied first), with SHA256SUMS;
    the parts, in order."""
    if part_bytes < 1:
        raise ValueError(f"no room for a part: {part_bytes} bytes a call (lower the margin, or carry less)")
    if not source.is_dir() or not any(p.is_file() for p in source.rglob("*")):
        raise ValueError(f"{source} holds no files to carry")
    data = tar_of(source)
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
    return [m.name for m in members if m.isfile()]


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
    j = sub.add_parser("join", help="there: check the parts and unpack them")
    j.add_argument("--parts", default=".device-carry/gpu")
    j.add_argument("--target", default="wheels")
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
            parts = split(Path(args.source), Path(args.out), room)
            print(f"{args.source}: {sum(p.stat().st_size for p in parts) / MIB:.1f} MiB in {len(parts)} parts of at "
                  f"most {room / MIB:.1f} MiB (the working tree sends {tree / MIB:.1f} MiB with each call)")
            for i, carried in enumerate(calls(parts, repo), 1):
                print(f"call {i}: carry {carried}")
            print(f"then, in the last call: python3 requirements/carry.py join --parts {args.out} "
                  f"--target {Path(args.source).parent}")
        else:
            files = join(Path(args.parts), Path(args.target))
            print(f"{len(files)} files unpacked into {args.target}")
    except (ValueError, OSError, tarfile.TarError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
