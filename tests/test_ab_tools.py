"""The A/B tools for two builds on a GPU machine: tools/ab_tree.sh writes an older commit's
files (the GPU machine has no git history) and tools/gpu_ab.sh checks its arguments before it
builds anything. The builds and the alternating runs need a GPU (tools/gpu_ab.sh's header)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    res = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], cwd=ROOT, capture_output=True)
    return res.returncode == 0


@pytest.mark.skipif(not _git_checkout(), reason="needs a git checkout with a commit")
def test_ab_tree_writes_the_files_of_the_commit(tmp_path):
    out = tmp_path / "old"
    res = subprocess.run(["bash", str(ROOT / "tools" / "ab_tree.sh"), "HEAD", str(out)],
                         capture_output=True, text=True, check=True)
    assert res.stdout.strip() == str(out)
    for rel in ("CMakeLists.txt", "pyproject.toml", "csrc/include/sparktune/sm90_fwd_kernel.h",
                "sparktune/__init__.py", "tools/devbuild.sh", "bench/spark_fwd.py"):
        assert (out / rel).is_file(), rel
    committed = subprocess.run(["git", "show", "HEAD:csrc/include/sparktune/sm90_fwd_kernel.h"],
                               cwd=ROOT, capture_output=True, check=True).stdout
    assert (out / "csrc/include/sparktune/sm90_fwd_kernel.h").read_bytes() == committed
    assert not (out / "tests").exists()  # only what a build and the benchmarks need


@pytest.mark.skipif(not _git_checkout(), reason="needs a git checkout with a commit")
def test_ab_tree_replaces_only_a_tree_it_wrote(tmp_path):
    tool = str(ROOT / "tools" / "ab_tree.sh")
    out = tmp_path / "old"
    subprocess.run(["bash", tool, "HEAD", str(out)], capture_output=True, check=True)
    (out / "stale.txt").write_text("from before")
    subprocess.run(["bash", tool, "HEAD", str(out)], capture_output=True, check=True)
    assert not (out / "stale.txt").exists() and (out / "CMakeLists.txt").is_file()
    other = tmp_path / "mine"
    other.mkdir()
    (other / "keep.txt").write_text("not a tree")
    res = subprocess.run(["bash", tool, "HEAD", str(other)], capture_output=True, text=True)
    assert res.returncode == 2 and "was not written by tools/ab_tree.sh" in res.stderr
    assert (other / "keep.txt").read_text() == "not a tree" and len(list(other.iterdir())) == 1


@pytest.mark.skipif(not _git_checkout(), reason="needs a git checkout with a commit")
def test_ab_tree_names_a_commit_it_cannot_find(tmp_path):
    res = subprocess.run(["bash", str(ROOT / "tools" / "ab_tree.sh"), "no-such-rev-0123", str(tmp_path / "x")],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "no commit no-such-rev-0123" in res.stderr


@pytest.mark.parametrize("args, says", [
    (["x", "p", "2", "python3"], "usage: tools/gpu_ab.sh"),
    (["MISSING", "p", "2", "--", "true"], "is not a tree from tools/ab_tree.sh"),
    (["TREE", "p", "zz", "--", "true"], "ROUNDS must be a positive integer"),
    (["TREE", "p", "0", "--", "true"], "ROUNDS must be at least 1"),
])
def test_gpu_ab_refuses_bad_arguments_before_building(tmp_path, args, says):
    tree = tmp_path / "tree"
    (tree / "sparktune").mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text("")
    args = [str(tree) if a == "TREE" else str(tmp_path / "missing") if a == "MISSING" else a
            for a in args]
    res = subprocess.run(["bash", str(ROOT / "tools" / "gpu_ab.sh"), *args],
                         capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)})
    assert res.returncode == 2, res.stderr
    assert says in res.stderr
    assert not (tmp_path / "ab").exists()  # nothing built, nothing written
