"""build.py rebase on synthetic releases: clean carry, conflict, --continue, --abort, moved hooks."""
import ast
import subprocess
import zipfile

import pytest

from conftest import ROOT, pinned_wheel, run_build
from specprof_build import export, git, hookmap, rebase, release
from specprof_build.errors import BuildError

OLD = '''def other():
    return 0


def cycle(batch):
    prepare(batch)
    out = forward(batch)
    return out
'''
PATCHED = OLD.replace("    out = forward(batch)\n", "    specprof.P.mark('prep')\n    out = forward(batch)\n")


def wheel(path, version, source):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("sglang/__init__.py", "")
        z.writestr("sglang/worker.py", source)
        z.writestr(f"sglang-{version}.dist-info/METADATA", f"Name: sglang\nVersion: {version}\n")
    return path


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A patches/ folder with a one-patch series for 1.0.0, and a work folder, both temporary."""
    return series_env(tmp_path, monkeypatch, OLD, PATCHED)


def series_env(tmp_path, monkeypatch, old_source, patched_source):
    patches = tmp_path / "patches"
    monkeypatch.setattr(release, "PATCHES", patches)
    monkeypatch.setattr(rebase, "WORK", tmp_path / "work")
    repo = tmp_path / "author"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True,  # noqa: E731
                                    env={**export.IDENTITY, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    git("init", "-q")
    (repo / "sglang").mkdir()
    (repo / "sglang" / "worker.py").write_text(old_source)
    git("add", "-A")
    git("commit", "-q", "-m", "upstream")
    (repo / "sglang" / "worker.py").write_text(patched_source)
    git("commit", "-q", "-am", "worker: mark prep\n\nDescription: why\nForwarded: not-needed\nLast-Update: 2026-11-29")
    d = patches / "sglang-1.0.0"
    export.write_series(d, [("worker-mark.patch", export.export_commit(repo, "HEAD"))])
    pin = release.Pin("1.0.0", 1, {"sglang-1.0.0-py3-none-any.whl": "0" * 64})
    (d / "pin.toml").write_text(release.format_pin(pin))
    old = release.Release("1.0.0", d, pin, [d / "worker-mark.patch"])
    old_wheel = wheel(tmp_path / "sglang-1.0.0-py3-none-any.whl", "1.0.0", old_source)
    return tmp_path, patches, old, old_wheel


def new_release(tmp_path, source, version="1.1.0"):
    pin = release.Pin(version, 1, {f"sglang-{version}-py3-none-any.whl": "1" * 64})
    return pin, wheel(tmp_path / f"sglang-{version}-py3-none-any.whl", version, source)


def quiet(msg):
    pass


def test_carries_the_series_across_moved_lines(env):
    tmp, patches, old, old_wheel = env
    moved = "# a new upstream header\n" * 5 + OLD
    pin, new_wheel = new_release(tmp, moved)
    dest = rebase.rebase_trees(old, old_wheel, pin, new_wheel, quiet)
    assert dest == patches / "sglang-1.1.0"
    assert (dest / "series").read_text() == "worker-mark.patch\n"
    text = (dest / "worker-mark.patch").read_text()
    assert "\n@@ -9,5 +9,6 @@ def other():\n" in text, text  # five lines further down than before
    assert "Description: why\nForwarded: not-needed\nLast-Update: 2026-11-29" in text  # headers kept
    assert release.parse_pin((dest / "pin.toml").read_text()) == pin
    assert not (tmp / "work" / "sglang-1.1.0").exists()
    assert release.lint(dest) == []


def test_conflict_writes_nothing_then_continue_exports(env):
    tmp, patches, old, old_wheel = env
    changed = OLD.replace("    out = forward(batch)\n", "    out = forward(batch, fast=True)\n")
    pin, new_wheel = new_release(tmp, changed)
    with pytest.raises(BuildError) as e:
        rebase.rebase_trees(old, old_wheel, pin, new_wheel, quiet)
    msg = str(e.value)
    assert "worker-mark.patch conflicts with sglang 1.1.0 in sglang/worker.py" in msg
    assert "--continue" in msg and "--abort" in msg
    assert not (patches / "sglang-1.1.0").exists()
    work = tmp / "work" / "sglang-1.1.0"
    # still unresolved: --continue says so again
    with pytest.raises(BuildError, match="conflicts"):
        rebase.resume("1.1.0", quiet)
    (work / "sglang" / "worker.py").write_text(changed.replace(
        "    out = forward(batch, fast=True)\n", "    specprof.P.mark('prep')\n    out = forward(batch, fast=True)\n"))
    subprocess.run(["git", "add", "-A"], cwd=work, check=True)
    dest = rebase.resume("1.1.0", quiet)
    assert "+    specprof.P.mark('prep')\n     out = forward(batch, fast=True)" in (dest / "worker-mark.patch").read_text()
    assert not work.exists()


def test_abort_leaves_patches_as_they_were(env):
    tmp, patches, old, old_wheel = env
    before = sorted(p.relative_to(patches) for p in patches.rglob("*"))
    pin, new_wheel = new_release(tmp, OLD.replace("forward(batch)", "forward(batch, x)"))
    with pytest.raises(BuildError):
        rebase.rebase_trees(old, old_wheel, pin, new_wheel, quiet)
    rebase.abort("1.1.0", quiet)
    assert not (tmp / "work" / "sglang-1.1.0").exists()
    assert sorted(p.relative_to(patches) for p in patches.rglob("*")) == before
    with pytest.raises(BuildError, match="No rebase onto 1.1.0 is in progress"):
        rebase.abort("1.1.0", quiet)


def test_interrupted_rebase_is_refused_until_continue_or_abort(env, monkeypatch):
    tmp, patches, old, old_wheel = env
    pin, new_wheel = new_release(tmp, OLD.replace("forward(batch)", "forward(batch, x)"))
    with pytest.raises(BuildError):
        rebase.rebase_trees(old, old_wheel, pin, new_wheel, quiet)
    monkeypatch.setattr(rebase, "published_pin", lambda v: pytest.fail("must not reach the network"))
    with pytest.raises(BuildError, match="in progress .*--continue.*--abort"):
        rebase.start("1.1.0", "1.0.0", tmp / "cache", quiet)


def test_already_rebased_target_is_refused(env):
    tmp, patches, old, old_wheel = env
    pin, new_wheel = new_release(tmp, OLD)
    rebase.rebase_trees(old, old_wheel, pin, new_wheel, quiet)
    with pytest.raises(BuildError, match="patches/sglang-1.1.0 already has a series"):
        rebase.start("1.1.0", "1.0.0", tmp / "cache", quiet)


def test_hook_that_applies_but_moved_function_is_caught(env):
    tmp, patches, old, old_wheel = env
    renamed = OLD.replace("def cycle(batch):", "def legacy_cycle(batch):")
    pin, new_wheel = new_release(tmp, renamed)
    with pytest.raises(BuildError) as e:
        rebase.rebase_trees(old, old_wheel, pin, new_wheel, quiet)
    assert "specprof.P.mark('prep'): sglang/worker.py:cycle -> sglang/worker.py:legacy_cycle" in str(e.value)
    assert not (patches / "sglang-1.1.0").exists()
    dest = rebase.resume("1.1.0", quiet, accept_moves=True)
    assert (dest / "worker-mark.patch").is_file()


SIZED = OLD.replace("    prepare(batch)\n", "    size = len(batch)\n    prepare(batch)\n    log(batch)\n    check(batch)\n")
SIZED_PATCHED = SIZED.replace("    out = forward(batch)\n", "    specprof.P.mark('prep', size)\n    out = forward(batch)\n")
RENAMED = SIZED.replace("size = len(batch)", "count = len(batch)")  # four lines above the hook: merges cleanly


def _unbound_refusal(e, work):
    msg = str(e.value)
    assert msg == (f"specprof.P.mark('prep') in sglang/worker.py line 10 (worker-mark.patch) reads 'size', which is "
                   f"not bound there in sglang 1.1.0: the worker would stop with a NameError at its first cycle; "
                   f"correct the commit that added it in {work} (git commit --amend when it is the last, else git "
                   f"rebase -i upstream-1.1.0), then run python build.py rebase --onto 1.1.0 --continue; nothing was "
                   f"written to patches/.")


def _amend(work, tmp):
    subprocess.run(["git", "commit", "-q", "-a", "--amend", "--no-edit"], cwd=work, check=True, capture_output=True,
                   env={**export.IDENTITY, "PATH": "/usr/bin:/bin", "HOME": str(tmp)})


def test_a_clean_merge_whose_hook_reads_a_renamed_name_is_not_exported(tmp_path, monkeypatch):
    """The hook's line merges cleanly, but the local it reads was renamed upstream: the export
    is refused in one sentence naming the hook, the name, the file and line, and the patch; the
    rebase stays, and once the commit is corrected --continue exports it."""
    tmp, patches, old, old_wheel = series_env(tmp_path, monkeypatch, SIZED, SIZED_PATCHED)
    pin, new_wheel = new_release(tmp, RENAMED)
    work = tmp / "work" / "sglang-1.1.0"
    with pytest.raises(BuildError) as e:
        rebase.rebase_trees(old, old_wheel, pin, new_wheel, quiet)
    _unbound_refusal(e, work)
    assert not (patches / "sglang-1.1.0").exists() and not (patches / ".sglang-1.1.0.partial").exists()
    with pytest.raises(BuildError) as e:  # nothing corrected yet: --continue says the same
        rebase.resume("1.1.0", quiet)
    _unbound_refusal(e, work)
    fixed = RENAMED.replace("    out = forward(batch)\n", "    specprof.P.mark('prep', count)\n    out = forward(batch)\n")
    (work / "sglang" / "worker.py").write_text(fixed)
    with pytest.raises(BuildError, match=r"has changes that are in no commit \(sglang/worker.py\); commit each"):
        rebase.resume("1.1.0", quiet)  # the series is the commits: a fix left outside them is not in it
    assert not (patches / "sglang-1.1.0").exists()
    _amend(work, tmp)
    dest = rebase.resume("1.1.0", quiet)
    assert "+    specprof.P.mark('prep', count)\n" in (dest / "worker-mark.patch").read_text()
    assert not work.exists()


def test_a_conflict_resolved_with_the_old_name_is_not_exported_by_continue(tmp_path, monkeypatch):
    """Issue #41: the conflict is resolved keeping the hook as it was, reading a name upstream
    renamed; --continue refuses to export it, and exports the corrected commit."""
    tmp, patches, old, old_wheel = series_env(tmp_path, monkeypatch, SIZED, SIZED_PATCHED)
    changed = RENAMED.replace("    out = forward(batch)\n", "    out = forward(batch, fast=True)\n")
    pin, new_wheel = new_release(tmp, changed)
    with pytest.raises(BuildError, match="conflicts with sglang 1.1.0"):
        rebase.rebase_trees(old, old_wheel, pin, new_wheel, quiet)
    work = tmp / "work" / "sglang-1.1.0"
    hook = "    out = forward(batch, fast=True)\n"
    (work / "sglang" / "worker.py").write_text(changed.replace(hook, "    specprof.P.mark('prep', size)\n" + hook))
    subprocess.run(["git", "add", "-A"], cwd=work, check=True)
    with pytest.raises(BuildError) as e:
        rebase.resume("1.1.0", quiet)
    _unbound_refusal(e, work)
    assert not (patches / "sglang-1.1.0").exists()
    (work / "sglang" / "worker.py").write_text(changed.replace(hook, "    specprof.P.mark('prep', count)\n" + hook))
    _amend(work, tmp)
    dest = rebase.resume("1.1.0", quiet)
    assert "+    specprof.P.mark('prep', count)\n     out = forward(batch, fast=True)" in (
        dest / "worker-mark.patch").read_text()


UNBOUND_CASES = """\
import os
from x import y as z
LIMIT = 3


def later():
    gone = 1


class W:
    field = 1

    def f(self, a, *rest, k=0, **kw):
        specprof.P.mark('ok', a, rest, k, kw, self.bs, os.sep, z, LIMIT, len, f"{a}", lambda q: q + a,
                        [i for i in a], later, W)
        specprof.P.mark('other_function', gone)
        specprof.P.mark('class_body', field)
        specprof.P.mark('before_bound', b.x)
        b = 2
        specprof.P.mark('after_bound', b)
        for item in a:
            specprof.P.mark('loop', item)
        try:
            pass
        except OSError as err:
            specprof.P.mark('handler', err)

        def inner():
            specprof.P.mark('closure', a, b, inner)
        specprof_args.validate(missing)
"""


def test_unbound_reads_knows_pythons_scopes(tmp_path):
    """Bound: the innermost function's parameters and what it binds up to the call; what the
    enclosing functions and the module bind; a builtin; an argument's own lambda parameters.
    Unbound: a local of another function, a class body's name from a method, a local read
    before its assignment, and anything in a call to specprof_args too."""
    (tmp_path / "m.py").write_text(UNBOUND_CASES)
    found = hookmap.unbound_reads(tmp_path, ["m.py", "absent.py", "notes.txt"])
    assert [(u.line, u.hook, u.name) for u in found] == [
        (16, "specprof.P.mark('other_function')", "gone"),
        (17, "specprof.P.mark('class_body')", "field"),
        (18, "specprof.P.mark('before_bound')", "b"),
        (30, "specprof_args.validate", "missing"),
    ]
    (tmp_path / "star.py").write_text("from x import *\n\ndef f():\n    specprof.P.mark('a', anything)\n")
    assert hookmap.unbound_reads(tmp_path, ["star.py"]) == []  # any name may come from the star
    (tmp_path / "bad.py").write_text("def f(:\n")
    with pytest.raises(BuildError, match=r"^bad.py is not valid Python with the series applied \(line 1: "):
        hookmap.unbound_reads(tmp_path, ["bad.py"])


def test_hook_map_names_the_enclosing_function():
    src = "class W:\n    def f(self):\n        specprof.P.mark('a')\n        x = 1\n\ndef g():\n    specprof_args.validate(x)\n"
    assert hookmap.hooks_in(src, "w.py") == [("W.f", "specprof.P.mark('a')"), ("g", "specprof_args.validate")]


def test_rebase_command_line_errors():
    proc = run_build("rebase")
    assert proc.returncode == 2 and "--onto" in proc.stderr
    proc = run_build("rebase", "--onto", "0.5.12", "--from", "0.5.12")
    assert proc.returncode == 1 and "nothing to rebase" in proc.stderr
    proc = run_build("rebase", "--onto", "9.9.9", "--continue")
    assert proc.returncode == 1 and "No rebase onto 9.9.9 is in progress" in proc.stderr
    proc = run_build("rebase", "--onto", "9.9.9", "--continue", "--abort")
    assert proc.returncode == 2


@pytest.mark.parametrize("version", release.available())
def test_every_series_round_trips_byte_for_byte(version):
    from specprof_build import fetch

    assert rebase.roundtrip(version, fetch.default_cache()) == []


def test_interrupted_before_git_rebase_then_continue(env, monkeypatch):
    tmp, patches, old, old_wheel = env
    pin, new_wheel = new_release(tmp, "# moved\n" * 3 + OLD)
    real = git.run

    def interrupt_at_rebase(args, cwd, **kw):
        if args[0] == "rebase":
            raise KeyboardInterrupt
        return real(args, cwd, **kw)

    monkeypatch.setattr(git, "run", interrupt_at_rebase)
    with pytest.raises(KeyboardInterrupt):
        rebase.rebase_trees(old, old_wheel, pin, new_wheel, quiet)
    monkeypatch.setattr(git, "run", real)
    assert not (patches / "sglang-1.1.0").exists()
    dest = rebase.resume("1.1.0", quiet)  # --continue begins the rebase that never started
    assert "\n@@ -7,5 +7,6 @@ def other():\n" in (dest / "worker-mark.patch").read_text()


@pytest.mark.parametrize("version", release.available())
def test_every_model_runner_attribute_a_hook_reads_exists_in_its_release(version):
    """A hook's arguments are evaluated in upstream's code, with the profiler off too: an
    attribute the release does not have (0.5.14 renamed the model runner's `graph_runner`)
    would stop the worker. Each `model_runner.X` a series reads is one its release sets."""
    import re

    rel = release.load(version)
    added = "\n".join(line for p in rel.patches for line in p.read_text().splitlines() if line.startswith("+"))
    names = set(re.findall(r"model_runner\.(\w+)", added))
    with zipfile.ZipFile(pinned_wheel(version)) as z:
        src = z.read("sglang/srt/model_executor/model_runner.py").decode()
    for name in names:
        assert re.search(rf"self\.{name}\s*[:=]|def {name}\(", src), f"{version}: model_runner.{name} is not set there"


def _defined_attributes(tree, wanted):
    """Those of `wanted` that the release's code sets or declares somewhere (`.x = `, `x: T`
    in a class body, `def x`): an attribute a hook reads that is in none of them does not exist."""
    import re

    if not wanted:
        return set()
    text = "\n".join(p.read_text(errors="replace") for p in tree.rglob("*.py"))
    alt = "|".join(sorted(map(re.escape, wanted)))
    found = {a or b for a, b in re.findall(rf"\.({alt})\s*(?::[^=\n]*)?=(?!=)|def\s+({alt})\b", text)}
    rest = wanted - found
    if rest:  # class-body declarations (dataclass fields), a slower scan, for what is left
        alt = "|".join(sorted(map(re.escape, rest)))
        found |= set(re.findall(rf"^[ \t]+({alt})\s*(?::|=(?!=))", text, re.M))
    return found


def hook_reads(tree, files):
    """(file, line, problem) for each name or attribute a hook call reads that is not there:
    a name not bound where the call runs (hookmap.unbound_reads, as build.py checks it), or an
    attribute no code of the release sets."""
    problems = [(u.file, u.line, f"name {u.name!r} is not bound there") for u in hookmap.unbound_reads(tree, files)]
    reads = []
    for rel_path in files:
        for call, _ in hookmap.hook_calls(hookmap.parse(tree, rel_path)):
            for arg in list(call.args) + [k.value for k in call.keywords]:
                reads += [(rel_path, call.lineno, n.attr) for n in ast.walk(arg) if isinstance(n, ast.Attribute)]
    there = _defined_attributes(tree, {a for _, _, a in reads})
    problems += [(f, line, f"attribute .{a} is set nowhere") for f, line, a in reads if a not in there]
    return problems


@pytest.mark.parametrize("version", release.available())
def test_every_name_a_hook_reads_is_there_in_its_release(version, tmp_path):
    """A hook's arguments are upstream names (a local, `batch.seq_lens_cpu`, `self.bs`): a
    rebase that applies cleanly still leaves the old name where upstream renamed it (0.5.17's
    `can_cuda_graph`), which stops the worker at its first cycle. Each name a hook call reads
    is bound in its function by then, and each attribute is one the release sets."""
    from specprof_build import apply, repack

    rel = release.load(version)
    tree = tmp_path / "tree"
    repack.unpack_sources(pinned_wheel(version), tree)
    apply.apply_series(tree, rel.patches, log=lambda m: None)
    files = sorted({f for p in rel.patches for f in apply.hunks(p.read_text())})
    assert files
    assert hook_reads(tree, files) == []


def test_an_imported_patch_names_its_file_in_a_trailer_that_the_export_drops(tmp_path):
    """Electron's Patch-Filename: the commit says which file it came from, and the exported
    patch is the file's bytes again."""
    from specprof_build import git

    repo = tmp_path / "r"
    repo.mkdir()
    (repo / "f.py").write_text("a = 1\n")
    git.run(["init", "-q"], repo, check=True)
    git.run(["add", "-A"], repo, check=True)
    git.run(["commit", "-q", "-m", "upstream"], repo, check=True)
    (repo / "f.py").write_text("a = 2\n")
    git.run(["commit", "-q", "-am", "f: two\n\nDescription: why.\nForwarded: not-needed\nLast-Update: 2026-12-05"],
            repo, check=True)
    patch = tmp_path / "f-two.patch"
    patch.write_text(export.export_commit(repo, "HEAD"))
    git.run(["reset", "-q", "--hard", "HEAD~1"], repo, check=True)
    assert git.am(repo, patch).returncode == 0
    message = git.run(["log", "-1", "--format=%B"], repo, check=True).stdout
    assert git.patch_filename(message) == "f-two.patch"
    assert "Patch-Filename: f-two.patch" in git.run([*export.FORMAT_PATCH, "-1", "HEAD"], repo).stdout
    assert export.export_commit(repo, "HEAD") == patch.read_text()
