"""Applying the series: exact on a pristine tree, refused when shifted or changed."""
import pytest

from specprof_build import apply, release, repack
from specprof_build.errors import BuildError


@pytest.fixture
def tree(tmp_path, upstream_wheel):
    return repack.unpack(upstream_wheel, tmp_path / "tree")


def target_of(rel):
    """The first file the first patch touches, and its hunks' start lines."""
    (path, starts), *_ = apply.hunks(rel.patches[0].read_text()).items()
    return path, starts


def test_series_applies_to_pristine_upstream(tree, default_release):
    path, _ = target_of(default_release)
    before = (tree / path).read_text()
    apply.apply_series(tree, default_release.patches, log=lambda m: None)
    after = (tree / path).read_text()
    assert before != after and "specprof_args" in after


def test_check_only_leaves_the_tree_alone(tree, default_release):
    path, _ = target_of(default_release)
    before = (tree / path).read_text()
    apply.apply_series(tree, default_release.patches, log=lambda m: None, write=False)
    assert (tree / path).read_text() == before


def test_tree_shifted_by_one_line_is_refused_naming_patch_file_hunk(tree, default_release):
    path, _ = target_of(default_release)
    f = tree / path
    f.write_text("# one more line\n" + f.read_text())
    with pytest.raises(BuildError) as e:
        apply.apply_series(tree, default_release.patches, log=lambda m: None)
    msg = str(e.value)
    assert default_release.patches[0].name in msg
    assert f"hunk #1 of {path}" in msg
    assert "offset" in msg


def test_changed_context_is_refused_naming_the_hunk(tree, default_release):
    path, starts = target_of(default_release)
    f = tree / path
    lines = f.read_text().splitlines(keepends=True)
    # Break the context of the second hunk only (its first line is context).
    lines[starts[1] - 1] = "# upstream rewrote this line\n"
    f.write_text("".join(lines))
    with pytest.raises(BuildError) as e:
        apply.apply_series(tree, default_release.patches, log=lambda m: None)
    msg = str(e.value)
    assert f"hunk #2 of {path} (at line {starts[1]}) does not apply" in msg
    assert default_release.patches[0].name in msg


def test_missing_file_is_named(tree, default_release):
    path, _ = target_of(default_release)
    (tree / path).unlink()
    with pytest.raises(BuildError, match=f"{path} does not exist"):
        apply.apply_series(tree, default_release.patches, log=lambda m: None)


def test_overlay_refuses_to_overwrite_upstream(tmp_path, tree):
    overlay = tmp_path / "overlay"
    clash = overlay / "sglang" / "srt" / "server_args.py"
    clash.parent.mkdir(parents=True)
    clash.write_text("x = 1\n")
    with pytest.raises(BuildError, match="overwrite upstream's sglang/srt/server_args.py"):
        apply.copy_overlay(overlay, tree, release.overlay_files(overlay), log=lambda m: None)


def test_hunk_table():
    text = ("diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -3,2 +3,3 @@\n a\n+b\n c\n"
            "@@ -40 +41,2 @@\n d\n+e\ndiff --git a/y.py b/y.py\n--- a/y.py\n+++ b/y.py\n@@ -7,1 +7,1 @@\n-f\n+g\n")
    assert apply.hunks(text) == {"x.py": [3, 40], "y.py": [7]}


@pytest.mark.parametrize("body, says", [
    ("diff --git a/sglang/a b b/sglang/a b\nnew file mode 120000\n--- /dev/null\n+++ b/sglang/a b\n@@ -0,0 +1 @@\n+/etc\n",
     "names a path build.py does not take"),
    ("diff --git a/sglang/link b/sglang/link\nnew file mode 120000\n--- /dev/null\n+++ b/sglang/link\n@@ -0,0 +1 @@\n+/etc\n",
     "adds or changes a symlink"),
    ("diff --git a/../x.py b/../x.py\n--- a/../x.py\n+++ b/../x.py\n@@ -1 +1 @@\n-a\n+b\n", "is outside the tree"),
    ("diff --git a/a.py b/b.py\nsimilarity index 100%\nrename from a.py\nrename to b.py\n", "renames or copies"),
    ("diff --git a/a.py b/a.py\r\n--- a/a.py\r\n+++ b/a.py\r\n@@ -1 +1 @@\r\n-a\r\n+b\r\n", "Windows line endings"),
])
def test_a_patch_that_reaches_outside_plain_files_is_refused(tmp_path, body, says):
    from specprof_build import apply as apply_mod
    from specprof_build.errors import BuildError

    tree = tmp_path / "tree"
    (tree / "sglang").mkdir(parents=True)
    (tree / "a.py").write_text("a\n")
    patch = tmp_path / "bad.patch"
    patch.write_bytes(body.encode())
    with pytest.raises(BuildError) as e:
        apply_mod.check_one(tree, patch)
    assert says in str(e.value) and "\n" not in str(e.value)
    assert not (tree / "sglang" / "link").exists() and (tree / "a.py").read_text() == "a\n"


def test_a_symlink_in_the_tree_stops_the_build_before_any_chmod(tmp_path):
    from specprof_build import repack
    from specprof_build.errors import BuildError

    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    outside.chmod(0o600)
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "link").symlink_to(outside)
    with pytest.raises(BuildError, match="is a symlink"):
        repack.normalize_modes(tree)
    assert outside.stat().st_mode & 0o777 == 0o600


def test_every_git_call_goes_through_one_environment(tmp_path, monkeypatch):
    """apply, export and rebase call git through specprof_build/git.py: the C locale, no
    repository above the work folder, the tools' identity; without git, one sentence."""
    import subprocess as sp

    from specprof_build import git

    repo = tmp_path / "r"
    (repo / "inner").mkdir(parents=True)
    sp.run(["git", "init", "-q", str(tmp_path)], check=True)  # a repository around the work folder
    proc = git.run(["rev-parse", "--show-toplevel"], repo / "inner")
    assert proc.returncode != 0 and "not a git repository" in proc.stderr  # the one above is not used
    git.run(["init", "-q"], repo, check=True)
    (repo / "f").write_text("x\n")
    git.run(["add", "f"], repo, check=True)
    git.run(["commit", "-q", "-m", "one"], repo, check=True)
    who = git.run(["log", "-1", "--format=%an %ae %ad", "--date=iso-strict"], repo, check=True).stdout.strip()
    assert who == "sglang-specprof sglang-specprof@users.noreply.github.com 2020-01-01T00:00:00+00:00"
    monkeypatch.setattr(git.shutil, "which", lambda name: None)
    with pytest.raises(BuildError, match="^git is not installed; build.py applies and rebases the patches with git.$"):
        git.run(["status"], repo)


def test_check_takes_two_patches_of_one_file_in_turn(tmp_path):
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    body = "".join(f"line {i}\n" for i in range(1, 21))
    (tree / "pkg" / "m.py").write_text(body)
    first = tmp_path / "a.patch"  # two lines at the top
    first.write_text("diff --git a/pkg/m.py b/pkg/m.py\n--- a/pkg/m.py\n+++ b/pkg/m.py\n"
                     "@@ -1,3 +1,5 @@\n+import x\n+\n line 1\n line 2\n line 3\n")
    second = tmp_path / "b.patch"  # one line lower down, numbered as the first patch leaves the file
    second.write_text("diff --git a/pkg/m.py b/pkg/m.py\n--- a/pkg/m.py\n+++ b/pkg/m.py\n"
                      "@@ -11,3 +11,4 @@\n line 9\n line 10\n+x.idle()\n line 11\n")
    apply.apply_series(tree, [first, second], log=lambda m: None, write=False)
    assert (tree / "pkg" / "m.py").read_text() == body  # checked, not written
    with pytest.raises(BuildError, match="b.patch: hunk #1 of pkg/m.py only applies"):
        apply.apply_series(tree, [second], log=lambda m: None, write=False)  # alone it is 2 lines off
    apply.apply_series(tree, [first, second], log=lambda m: None)
    assert (tree / "pkg" / "m.py").read_text().splitlines()[12] == "x.idle()"
