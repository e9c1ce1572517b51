"""requirements/carry.py: a folder split into parts that fit one call to a lent machine each, and joined there,
checked part by part and whole."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("carry", ROOT / "requirements" / "carry.py")
carry = importlib.util.module_from_spec(spec)
spec.loader.exec_module(carry)


def folder(tmp_path: Path) -> Path:
    source = tmp_path / "wheels" / "gpu"
    (source / "sub").mkdir(parents=True)
    (source / "a.whl").write_bytes(bytes(range(256)) * 40)  # 10,240 bytes
    (source / "requirements.txt").write_text("a==1 --hash=sha256:00\n")
    (source / "sub" / "b.bin").write_bytes(b"\x00\xff" * 3000)
    return source


def test_a_split_folder_joins_back_byte_for_byte(tmp_path):
    source = folder(tmp_path)
    parts = carry.split(source, tmp_path / "out", 4096)
    total = len(carry.tar_of(source))
    assert len(parts) == -(-total // 4096) and all(p.stat().st_size <= 4096 for p in parts)
    assert sum(p.stat().st_size for p in parts) == total
    sums = carry.read_sums(tmp_path / "out")
    assert set(sums) == {p.name for p in parts} | {carry.WHOLE}
    (tmp_path / "there" / "gpu").mkdir(parents=True)
    (tmp_path / "there" / "gpu" / "stale.whl").write_bytes(b"from an earlier join")
    files = carry.join(tmp_path / "out", tmp_path / "there")
    assert sorted(files) == ["gpu/a.whl", "gpu/requirements.txt", "gpu/sub/b.bin"]
    for name in ("a.whl", "requirements.txt", "sub/b.bin"):
        assert (tmp_path / "there" / "gpu" / name).read_bytes() == (source / name).read_bytes()
    assert not (tmp_path / "there" / "gpu" / "stale.whl").exists()  # the folder is replaced whole


def test_datasets_travel_gzipped_and_join_unpacks_them_plain_where_ibedl_data_dir_will_point(tmp_path, capsys):
    """The lent machine has no data: split adds the named dataset folders (gzipped: SciQ's 10 MB train.json is about
    2.3 MB), join writes them back byte for byte under <folder>/ibedl-data, and the loaders read them there."""
    import json

    from ibedl.training.data import load_dataset

    source, data = folder(tmp_path), tmp_path / "shared-data"
    (data / "sciq").mkdir(parents=True)
    rows = [{"question": f"Which is {w}?", "distractor1": "a", "distractor2": "b", "distractor3": "c",
             "correct_answer": w, "support": "It is."} for w in ("sun", "moon", "tree") * 200]
    (data / "sciq" / "test.json").write_text(json.dumps(rows))
    plain = len(carry.tar_of(source))
    packed = carry.tar_of(source, data, ("sciq",))
    assert len(packed) - plain < len((data / "sciq" / "test.json").read_bytes()) / 5  # compressed
    carry.split(source, tmp_path / "out", 4096, data, ("sciq",))
    files = carry.join(tmp_path / "out", tmp_path / "there")
    assert "gpu/ibedl-data/sciq/test.json" in files
    unpacked = tmp_path / "there" / "gpu" / "ibedl-data"
    assert (unpacked / "sciq" / "test.json").read_bytes() == (data / "sciq" / "test.json").read_bytes()
    assert not list(unpacked.rglob("*.gz"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("IBEDL_DATA_DIR", str(unpacked))
        assert len(load_dataset("sciq", "test")) == 600
    with pytest.raises(ValueError, match="dataset 'obqa': .* holds no files"):
        carry.tar_of(source, data, ("obqa",))


def test_a_missing_or_altered_part_is_refused_by_name(tmp_path):
    parts = carry.split(folder(tmp_path), tmp_path / "out", 4096)
    parts[1].rename(tmp_path / "aside")
    with pytest.raises(ValueError, match=f"parts not here yet: {parts[1].name} "):
        carry.join(tmp_path / "out", tmp_path / "there")
    (tmp_path / "aside").rename(parts[1])
    data = bytearray(parts[0].read_bytes())
    data[100] ^= 1
    parts[0].write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{parts[0].name} is altered"):
        carry.join(tmp_path / "out", tmp_path / "there")
    assert not (tmp_path / "there").exists()  # nothing unpacked from altered parts
    (tmp_path / "out" / carry.SUMS).write_text("not a sum\n")
    with pytest.raises(ValueError, match="SHA256SUMS line 1 is not '<sha256>  <name>': 'not a sum'"):
        carry.join(tmp_path / "out", tmp_path / "there")
    (tmp_path / "out" / carry.SUMS).unlink()
    with pytest.raises(ValueError, match="SHA256SUMS is missing: it comes with the last part"):
        carry.join(tmp_path / "out", tmp_path / "there")


@pytest.mark.parametrize("names", [["../escaped.txt"], ["../there/gpu/x"], ["/abs.txt"], ["gpu/a", "other/b"],
                                   ["./gpu"]])
def test_a_tar_reaching_out_of_one_folder_is_refused_before_anything_is_touched(tmp_path, names):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
    data = buffer.getvalue()
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-00").write_bytes(data)
    (out / carry.SUMS).write_text(f"{carry.sha256(data)}  part-00\n{carry.sha256(data)}  {carry.WHOLE}\n")
    (tmp_path / "there" / "gpu").mkdir(parents=True)
    (tmp_path / "there" / "gpu" / "kept.whl").write_bytes(b"k")
    with pytest.raises(ValueError, match="refused"):
        carry.join(out, tmp_path / "there")
    assert not (tmp_path / "escaped.txt").exists() and (out / "part-00").is_file()  # nothing outside removed
    assert (tmp_path / "there" / "gpu" / "kept.whl").read_bytes() == b"k"  # nor the folder a join would replace


def test_split_counts_what_travels_with_each_call_and_says_what_each_carries(tmp_path, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/.device-carry/\n/wheels/\n")
    (repo / "tracked.bin").write_bytes(b"x" * 5000)
    subprocess.run(["git", "-C", str(repo), "add", "tracked.bin", ".gitignore"], check=True)
    (repo / "untracked.txt").write_bytes(b"y" * 1000)  # not ignored: it travels too
    source = folder(repo)  # repo/wheels/gpu: ignored, carried in parts
    assert carry.tree_bytes(repo) == 5000 + 1000 + len((repo / ".gitignore").read_bytes())
    budget_mib = (carry.tree_bytes(repo) + 8192) / carry.MIB
    argv = ["split", "--repo", str(repo), "--source", str(source), "--out", str(repo / ".device-carry" / "gpu"),
            "--budget-mib", str(budget_mib), "--margin-mib", "0"]
    assert carry.main(argv) == 0
    out = capsys.readouterr().out
    parts = sorted((repo / ".device-carry" / "gpu").glob("part-*"))
    assert all(p.stat().st_size <= 8192 for p in parts) and len(parts) >= 2
    assert f"call {len(parts)}: carry ['.device-carry/gpu/{parts[-1].name}', '.device-carry/gpu/SHA256SUMS']" in out
    assert "call 1: carry ['.device-carry/gpu/part-00']" in out
    assert "then, in the last call: python3 requirements/carry.py join --parts" in out
    assert out.rstrip().endswith(f"--target {repo / 'wheels'}")  # no datasets asked: no IBEDL_DATA_DIR to export
    (tmp_path / "data" / "obqa").mkdir(parents=True)
    (tmp_path / "data" / "obqa" / "train.jsonl").write_text("{}\n")
    assert carry.main([*argv, "--datasets", "obqa", "--data-dir", str(tmp_path / "data")]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"&& export IBEDL_DATA_DIR={source / 'ibedl-data'}")
    assert carry.main([*argv[:-4], "--budget-mib", str(carry.tree_bytes(repo) / carry.MIB), "--margin-mib", "0"]) == 2
    assert "no room for a part" in capsys.readouterr().err
    assert carry.main([*argv[:-6], "--out", str(tmp_path / "elsewhere"), "--budget-mib", "64"]) == 2
    assert "is outside the checkout" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        carry.main([*argv[:-2], "--margin-mib", "-1"])
    assert "--margin-mib >= 0, got" in capsys.readouterr().err
    assert carry.main(["join", "--parts", str(repo / ".device-carry" / "gpu"), "--target", str(tmp_path / "w")]) == 0
    assert (tmp_path / "w" / "gpu" / "a.whl").read_bytes() == (source / "a.whl").read_bytes()


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=True, text=True).stdout


@pytest.fixture
def repo(tmp_path) -> Path:
    repo = tmp_path / "repo"
    (repo / "results" / "sub").mkdir(parents=True)
    (repo / "code").mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "code" / "a.py").write_bytes(b"a" * 1000)
    (repo / "results" / "r.json").write_bytes(b"r" * 5000)
    (repo / "results" / "sub" / "s.json").write_bytes(b"s" * 3000)
    (repo / "twin.bin").write_bytes(b"t" * 2000)
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    (repo / "code" / "a.py").write_bytes(b"b" * 1000)  # a change of one's own, unstaged: kept as it is
    exclude = Path(git(repo, "rev-parse", "--git-path", "info/exclude").strip())
    exclude = exclude if exclude.is_absolute() else repo / exclude
    exclude.parent.mkdir(parents=True, exist_ok=True)
    exclude.write_text("/.whl/\n")  # a line of one's own: kept
    return repo


def test_slim_leaves_paths_out_of_each_call_keeps_them_on_disk_refuses_commits_and_restore_undoes_it(repo):
    before = git(repo, "status", "--porcelain")
    assert carry.tree_bytes(repo) == 11000
    left = carry.slim(repo, ["results", "twin.bin"])
    assert sorted(left) == ["results/r.json", "results/sub/s.json", "twin.bin"]
    assert carry.tree_bytes(repo) == 1000  # what a call now sends: code/a.py
    assert (repo / "results" / "sub" / "s.json").read_bytes() == b"s" * 3000  # nothing on disk changed
    assert carry.slim_paths(repo) == ["results", "twin.bin"]
    assert carry.slim(repo, ["twin.bin", "results"]) == []  # already slim by these paths: nothing to do
    with pytest.raises(ValueError, match=r"already slim, leaving \['results', 'twin.bin'\]"):
        carry.slim(repo, ["results"])
    commit = subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                             "-a", "-m", "would delete them"], capture_output=True, text=True)
    assert commit.returncode != 0 and "make gpu-carry-restore before committing" in commit.stderr
    assert carry.restore(repo) == ["results", "twin.bin"]
    assert git(repo, "status", "--porcelain") == before  # the index whole, the unstaged change still there
    assert carry.tree_bytes(repo) == 11000 and carry.slim_paths(repo) is None
    assert (repo / ".git" / "info" / "exclude").read_text() == "/.whl/\n"
    assert not (repo / ".git" / "hooks" / "pre-commit").exists()
    assert carry.restore(repo) == []  # whole already: nothing to do


def test_slim_refuses_before_changing_anything(repo, capsys):
    before = git(repo, "status", "--porcelain")
    with pytest.raises(ValueError, match="--leave nowhere: git tracks nothing there"):
        carry.slim(repo, ["results", "nowhere"])
    for bad in ("../outside", "/abs", ".", "res*", "b[1]", "docs "):  # what a pattern would not ignore as named
        with pytest.raises(ValueError, match="is not a plain path inside the checkout"):
            carry.slim(repo, ["results", bad])
    (repo / "results" / "r.json").write_text("staged")
    git(repo, "add", "results/r.json")
    with pytest.raises(ValueError, match=r"staged changes under what slim leaves behind \(results/r.json\)"):
        carry.slim(repo, ["results"])
    git(repo, "reset", "-q", "--", "results/r.json")
    hook = repo / ".git" / "hooks" / "pre-commit"
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.write_text("#!/bin/sh\nexit 0\n")
    with pytest.raises(ValueError, match="pre-commit exists"):
        carry.slim(repo, ["results"])
    assert hook.read_text() == "#!/bin/sh\nexit 0\n" and carry.slim_paths(repo) is None
    hook.unlink()
    git(repo, "config", "core.hooksPath", str(repo.parent / "hooks-elsewhere"))
    with pytest.raises(ValueError, match="outside .*a hook there would refuse other repositories' commits too"):
        carry.slim(repo, ["results"])
    git(repo, "config", "--unset", "core.hooksPath")
    git(repo, "worktree", "add", "-q", str(repo.parent / "second"))
    with pytest.raises(ValueError, match="this checkout has 2 worktrees"):
        carry.slim(repo, ["results"])
    git(repo, "worktree", "remove", str(repo.parent / "second"))
    assert carry.slim_paths(repo) is None and not hook.exists()
    assert git(repo, "status", "--porcelain") == " M code/a.py\n M results/r.json\n" and before == " M code/a.py\n"
    assert carry.main(["slim", "--repo", str(repo), "--leave", "nowhere"]) == 2
    assert "git tracks nothing there" in capsys.readouterr().err
    assert carry.main(["slim", "--repo", str(repo.parent)]) == 2  # not a checkout: git's own words, no traceback
    assert "error: git rev-parse --git-path in" in capsys.readouterr().err


def test_split_after_slim_makes_fewer_larger_parts_and_says_how_to_restore(repo, capsys):
    (repo / ".gitignore").write_text("/.device-carry/\n/wheels/\n")
    source = folder(repo)
    argv = ["split", "--repo", str(repo), "--source", str(source), "--out", str(repo / ".device-carry" / "gpu"),
            "--budget-mib", str((carry.tree_bytes(repo) + 4096) / carry.MIB), "--margin-mib", "0"]
    assert carry.main(argv) == 0
    whole = len(list((repo / ".device-carry" / "gpu").glob("part-*")))
    assert "the tree is slim" not in capsys.readouterr().out
    assert carry.main(["slim", "--repo", str(repo), "--leave", "results"]) == 0
    assert "left behind: results (2 tracked files; the files stay on disk)" in capsys.readouterr().out
    assert carry.main(argv) == 0  # the same budget: 8,000 bytes of the tree more room in each call
    assert len(list((repo / ".device-carry" / "gpu").glob("part-*"))) < whole
    assert "the tree is slim (left behind: results); once the calls are done: make gpu-carry-restore" in \
        capsys.readouterr().out
    assert carry.main(["restore", "--repo", str(repo)]) == 0
    assert "the tree is whole again: results back in git's index" in capsys.readouterr().out


def test_what_slim_leaves_behind_by_default_is_tracked_here_and_not_what_the_gpu_runs_read():
    for path in carry.LEAVE:
        assert git(ROOT, "ls-files", "--", path).strip(), path
    from ibedl.training.config import load_config

    # the check's --artifact default, the stage-1 adapter its training starts from, the code, the CUDA tests, the
    # offline install's files
    inputs = ["artifacts/default", load_config(ROOT / "ibedl/training/configs/smollm2_science_ib_edl.yaml").init_from,
              "ibedl", "benchmarks/gpu_check.py", "tests/core/test_backends_torch_cuda.py",
              "tests/core/test_backends_cuda_graphs.py", "requirements"]
    assert inputs[1] == "artifacts/map"
    for path in inputs:
        assert (ROOT / path).exists() and not any(Path(path).is_relative_to(p) for p in carry.LEAVE), path


def test_restore_changes_nothing_when_a_commit_past_the_hook_dropped_what_it_would_restore(repo):
    carry.slim(repo, ["results"])
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--no-verify", "-m", "drops results")
    with pytest.raises(ValueError, match="HEAD holds nothing under results: a commit dropped them"):
        carry.restore(repo)
    assert carry.slim_paths(repo) == ["results"] and (repo / ".git" / "hooks" / "pre-commit").exists()
    exclude = repo / ".git" / "info" / "exclude"
    exclude.write_text(exclude.read_text().replace(carry.SLIM_END, ""))
    with pytest.raises(ValueError, match="the slim block has no end line"):
        carry.slim_paths(repo)
