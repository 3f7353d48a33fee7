"""build.py upstream: releases the series do not cover, and whether the newest series applies."""
import hashlib
import shutil

import pytest

from conftest import patches_with_gaps
from specprof_build import cli, release, upstream


def _file(name, sha="0" * 64, yanked=False):
    return {"filename": name, "hashes": {"sha256": sha}, "yanked": yanked}


def test_releases_from_the_file_list(tmp_path):
    data = {"files": [_file("sglang-0.5.8-py3-none-any.whl"), _file("sglang-0.5.8.tar.gz"),
                      _file("sglang-0.5.8.post1-py3-none-any.whl"), _file("sglang-0.5.9rc1-py3-none-any.whl"),
                      _file("sglang-0.5.10-py3-none-any.whl", yanked=True), _file("sglang-0.5.11.tar.gz"),
                      _file("sglang_router-0.1.0-py3-none-any.whl"), _file("sglang-0.5.12-cp312-cp312-linux.whl")]}
    assert upstream.releases(data) == ["0.5.8", "0.5.8.post1", "0.5.11", "0.5.12"]
    s = upstream.survey(data)
    assert s["newest_series"] == release.available()[-1] and s["newer"] == []
    assert s["without_series"] == [v for v in ["0.5.8", "0.5.8.post1", "0.5.11", "0.5.12"]
                                   if v not in release.available()]
    s = upstream.survey(data, patches_with_gaps(tmp_path, ("0.5.8", "0.5.12", "0.5.23"), "0.5.12"))
    assert s["newest_series"] == "0.5.23" and s["without_series"] == ["0.5.8.post1", "0.5.11"] and s["newer"] == []


def _fake_release(tmp_path, wheel, version, listed=None):
    """`wheel` published again as `version`: PyPI's list (`listed` releases and it), and its file."""
    name = wheel.name.replace(wheel.name.split("-")[1], version, 1)
    copy = tmp_path / name
    shutil.copyfile(wheel, copy)
    sha = hashlib.sha256(copy.read_bytes()).hexdigest()
    return copy, {"files": [_file(f"sglang-{v}-py3-none-any.whl") for v in (listed or release.available())]
                  + [_file(name, sha)]}


def _listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_newer_release_the_newest_series_applies_to(tmp_path, upstream_wheel, default_release, monkeypatch, capsys):
    wheel, data = _fake_release(tmp_path, upstream_wheel, "9.9.9", [default_release.version])
    monkeypatch.setattr(upstream, "simple_index", lambda timeout=30: data)
    patches = patches_with_gaps(tmp_path / "patches", [default_release.version], default_release.version)
    before = _listing(patches)
    code = cli.main(["upstream", "--patches", str(patches), "--from-wheel", str(wheel)])
    got = capsys.readouterr()
    out = got.out
    assert code == 0, got.err
    assert f"newer than {default_release.version}: 9.9.9" in out
    assert f"applies to 9.9.9 exactly: build.py rebase --onto 9.9.9 --from {default_release.version}" in out
    assert _listing(patches) == before  # wrote nothing


def test_a_newer_release_it_does_not_apply_to(tmp_path, upstream_wheel, default_release, monkeypatch, capsys):
    """The newest series (0.5.23) against a release whose files are 0.5.16's: exit 3, and why."""
    newest = release.available()[-1]
    if newest == default_release.version:
        pytest.skip("needs a series newer than the default release")
    wheel, data = _fake_release(tmp_path, upstream_wheel, "9.9.9")
    monkeypatch.setattr(upstream, "simple_index", lambda timeout=30: data)
    code = cli.main(["upstream", "--from-wheel", str(wheel)])
    out = capsys.readouterr().out
    assert code == upstream.BEHIND
    assert f"the {newest} series does not apply to 9.9.9 as it is (" in out
    assert f"build.py rebase --onto 9.9.9 --from {newest}, then resolve" in out


def test_no_index_is_one_sentence(monkeypatch, capsys):
    monkeypatch.setattr(upstream, "PYPI_SIMPLE", "http://127.0.0.1:9/simple/sglang/")
    code = cli.main(["upstream"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("build.py upstream: error: Cannot read PyPI's file list for sglang") == 1


def test_a_from_wheel_that_is_no_wheel_is_refused_even_when_up_to_date(tmp_path, monkeypatch, capsys):
    """Up to date, the wheel is not needed, but a file that is not one is still a mistake to name."""
    monkeypatch.setattr(upstream, "simple_index", lambda timeout=30: {"files": []})
    text = tmp_path / "passwd"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    for argv, says in ((["--from-wheel", str(text)], "is not a wheel (no .whl name, not a zip archive)"),
                       (["--from-wheel", str(tmp_path)], "is a folder; give the wheel file"),
                       (["--patches", str(tmp_path / "nonexistent")], "no such folder")):
        code = cli.main(["upstream", *argv])
        err = capsys.readouterr().err
        assert code == 1 and err.count("build.py upstream: error:") == 1 and says in err, err


def test_a_newer_release_a_hook_would_read_an_unbound_name_in(tmp_path, upstream_wheel, default_release,
                                                               unbound_patches, monkeypatch, capsys):
    """The series applies to the newer release's files exactly, but one hook reads a name not bound
    there (a rename upstream): not "applies exactly", but behind, with the hook and the name."""
    wheel, data = _fake_release(tmp_path, upstream_wheel, "9.9.9", [default_release.version])
    monkeypatch.setattr(upstream, "simple_index", lambda timeout=30: data)
    code = cli.main(["upstream", "--patches", str(unbound_patches), "--from-wheel", str(wheel)])
    out = capsys.readouterr().out
    assert code == upstream.BEHIND
    assert "does not apply to 9.9.9 as it is (" in out and "not bound there in sglang 9.9.9" in out
    assert "applies to 9.9.9 exactly" not in out
