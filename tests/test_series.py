"""The series file, the pin and their lint."""
import pytest

from conftest import patches_with_gaps
from specprof_build import release
from specprof_build.errors import BuildError

HEADER = "Subject: x\n\nDescription: why\nForwarded: not-needed\nLast-Update: 2026-11-29\n\n"
DIFF = "diff --git a/f.py b/f.py\n--- a/f.py\n+++ b/f.py\n@@ -1 +1 @@\n-a\n+b\n"


def make(tmp_path, series, patches):
    d = tmp_path / "sglang-9.9.9"
    d.mkdir()
    (d / "series").write_text(series)
    for name, text in patches.items():
        (d / name).write_text(text)
    return d


def test_every_committed_series_is_clean():
    for version in release.available():
        assert release.lint(release.PATCHES / f"sglang-{version}") == []
        rel = release.load(version)
        assert rel.patches and all(p.is_file() for p in rel.patches)


def test_entry_listed_twice(tmp_path):
    d = make(tmp_path, "a.patch\na.patch\n", {"a.patch": HEADER + DIFF})
    assert release.lint(d) == ["sglang-9.9.9/series lists a.patch twice."]


def test_listed_but_missing(tmp_path):
    d = make(tmp_path, "a.patch\nb.patch\n", {"a.patch": HEADER + DIFF})
    assert release.lint(d) == ["sglang-9.9.9/series lists b.patch, which does not exist."]


def test_present_but_unlisted(tmp_path):
    d = make(tmp_path, "a.patch\n", {"a.patch": HEADER + DIFF, "stray.patch": HEADER + DIFF})
    assert release.lint(d) == ["sglang-9.9.9/stray.patch is not listed in the series."]


def test_header_missing(tmp_path):
    d = make(tmp_path, "a.patch\n", {"a.patch": "Subject: x\n\nDescription: why\n\n" + DIFF})
    assert release.lint(d) == ["sglang-9.9.9/a.patch has no Forwarded:, Last-Update: header."]


def test_comments_and_blank_lines_are_not_entries():
    assert release.parse_series("# order matters\n\na.patch  # first\nb.patch\n") == ["a.patch", "b.patch"]


@pytest.mark.parametrize("line", ["../evil.patch", "sub/a.patch", "a.diff", "-x.patch"])
def test_series_rejects_paths_and_other_names(line):
    with pytest.raises(BuildError, match="line 1"):
        release.parse_series(line + "\n")


def test_pin_round_trips(default_release):
    text = release.format_pin(default_release.pin)
    assert release.parse_pin(text) == default_release.pin
    assert text == (default_release.directory / "pin.toml").read_text()


@pytest.mark.parametrize("text, fragment", [
    ("version = 1\nrevision = 1\n[artifacts]\n", "no version"),
    ('version = "0.5.12"\nrevision = 0\n[artifacts]\n"sglang-0.5.12-x.whl" = "' + "0" * 64 + '"\n', "revision"),
    ('version = "0.5.12"\nrevision = 1\n', r"no \[artifacts\]"),
    ('version = "0.5.12"\nrevision = 1\n[artifacts]\n"sglang-0.5.12-x.whl" = "abc"\n', "64 lowercase hex"),
    ('version = "0.5.12"\nrevision = 1\n[artifacts]\n"sglang-0.5.13-x.whl" = "' + "0" * 64 + '"\n', "not of sglang 0.5.12"),
    ("version = \n", "not valid TOML"),
])
def test_bad_pins_are_one_sentence(text, fragment):
    with pytest.raises(BuildError, match=fragment):
        release.parse_pin(text)


def test_pin_covers_every_published_wheel():
    # 0.5.12 publishes wheels for cp310..cp313 on x86_64 and aarch64 and no sdist.
    names = release.load("0.5.12").pin.artifacts
    assert len(names) == 8
    for py in ("cp310", "cp311", "cp312", "cp313"):
        for arch in ("x86_64", "aarch64"):
            assert f"sglang-0.5.12-{py}-{py}-manylinux_2_34_{arch}.whl" in names


def test_unknown_release_names_supported_ones_and_the_fix():
    with pytest.raises(BuildError) as e:
        release.load("0.0.1")
    msg = str(e.value)
    assert "0.5.12" in msg and "rebase --onto 0.0.1" in msg
    assert "the nearest 0.5.8 (newer)" in msg and msg.endswith("--from 0.5.8")


@pytest.mark.parametrize("version, near, start", [
    ("0.5.11", "the nearest 0.5.9 (older) and 0.5.12 (newer)", "0.5.9"),
    ("0.5.20", "the nearest 0.5.16 (older) and 0.5.23 (newer)", "0.5.16"),
    ("0.5.12.post2", "the nearest 0.5.12 (older) and 0.5.16 (newer)", "0.5.12"),
    ("0.6.0", "the nearest 0.5.23 (older)", "0.5.23"),
])
def test_an_unsupported_release_names_the_nearest_and_rebases_from_the_older(version, near, start, tmp_path):
    patches_with_gaps(tmp_path, ("0.5.8", "0.5.9", "0.5.12", "0.5.16", "0.5.23"), "0.5.16")
    with pytest.raises(BuildError) as e:
        release.load(version, tmp_path)
    msg = str(e.value)
    assert near in msg and msg.endswith(f"run: python build.py rebase --onto {version} --from {start}")


def test_every_hook_in_every_series_is_one_the_profiler_has():
    """Each call a series adds into the profiler names a hook the profiler has, with the
    arguments it takes, and each phase it marks is one the profile schema knows."""
    import ast
    import inspect
    import re
    from pathlib import Path

    import fakes
    from sglang.specprof.kernel_sampler import KernelSampler
    from sglang.specprof.profiler import NullProfiler, Profiler
    from sglang_specprof.schema import PHASES

    # while a kernel sample is on, it takes every hook in the profiler's place (kernel_sampler.py);
    # a profiler's hooks are its own or its recorder's bound methods (profiler.RECORDER_HOOKS)
    live = Profiler(fakes.FakeBackend(), log_table=False)

    root = Path(__file__).resolve().parent.parent / "patches"
    seen = set()
    for patch in sorted(root.glob("sglang-*/*.patch")):
        for line in patch.read_text().splitlines():
            m = re.search(r"specprof\.P\.(\w+)\((.*)\)\s*$", line)
            if not line.startswith("+") or not m:
                continue
            name, args = m.group(1), m.group(2)
            where = f"{patch.parent.name}/{patch.name}: {line[1:].strip()}"
            assert callable(getattr(NullProfiler, name, None)), where
            call = ast.parse(f"f({args})", mode="eval").body
            hooks = [getattr(NullProfiler, name), getattr(live, name), getattr(KernelSampler, name)]
            for hook in hooks:
                try:
                    inspect.signature(hook).bind(*([] if inspect.ismethod(hook) else [None]), *call.args)
                except TypeError as e:
                    raise AssertionError(f"{where}: {hook.__qualname__} takes other arguments ({e})") from None
            if name == "mark":
                (arg,) = call.args
                assert isinstance(arg, ast.Constant) and arg.value in PHASES, where
                seen.add(arg.value)
            seen.add(name)
    # the hooks a v2 series needs all appear somewhere
    assert {"begin", "end", "draft_end", "draft_replay_begin", "draft_replay_end", "capture_begin", "harvest",
            "commit_begin", "commit_end", "verify", "accept"} <= seen
