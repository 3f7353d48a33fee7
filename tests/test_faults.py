"""Faults a user or the machine can cause, and what each must do (docs/faults.md)."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, run_build
from fakes import FakeBackend
from specprof_build import cli, fetch, rebase, release
from specprof_build.errors import BuildError
from sglang.specprof import hooks, profiler as profiler_mod
from sglang_specprof import schema
from sglang.specprof.jsonl import JsonlSink
from sglang.specprof.profiler import NullProfiler, Profiler


def no_traceback(proc):
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def one_error_line(proc):
    errs = [l for l in proc.stderr.splitlines() if "error:" in l]
    assert len(errs) == 1, proc.stderr
    return errs[0]


def listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


# -- build.py -------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "corrupted", "foreign"])
def test_damaged_from_wheel_is_refused(tmp_path, upstream_wheel, default_release, damage):
    data = upstream_wheel.read_bytes()
    bad = tmp_path / upstream_wheel.name
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "corrupted":
        bad.write_bytes(data[:1000] + bytes([data[1000] ^ 0xFF]) + data[1001:])
    else:
        bad.write_bytes(b"PK\x03\x04 another zip entirely")
    out = tmp_path / "dist"
    proc = no_traceback(run_build("--from-wheel", str(bad), "--out", str(out)))
    assert proc.returncode == 1
    assert f"is none of the 8 files pinned for sglang {default_release.version}" in one_error_line(proc)
    assert listing(out) == []


def test_download_interrupted_half_way_leaves_no_partial_file(tmp_path, default_release, upstream_wheel, monkeypatch):
    cache = tmp_path / "cache"
    name = upstream_wheel.name

    def half_then_interrupt(cmd, **kw):
        dest = cmd[cmd.index("-d") + 1]
        with open(os.path.join(dest, name), "wb") as f:
            f.write(upstream_wheel.read_bytes()[:100_000])
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch.subprocess, "run", half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        fetch.fetch(default_release.pin, name, cache, log=lambda m: None)
    assert listing(cache) == []


def test_partial_left_by_a_killed_build_is_cleaned(tmp_path, default_release, upstream_wheel):
    cache = tmp_path / "cache"
    stale = cache / (fetch.PARTIAL + "killed")
    stale.mkdir(parents=True)
    (stale / upstream_wheel.name).write_bytes(b"half")
    with pytest.raises(BuildError, match="--offline forbids"):
        fetch.fetch(default_release.pin, upstream_wheel.name, cache, offline=True, log=lambda m: None)
    assert listing(cache) == []


def _no_network_env(cache):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0",
               PIP_TIMEOUT="3", SGLANG_SPECPROF_CACHE=str(cache))
    return env


def test_no_network_warm_cache_builds(tmp_path, upstream_wheel):
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(upstream_wheel, cache / upstream_wheel.name)
    proc = no_traceback(run_build("--out", str(tmp_path / "d"), env=_no_network_env(cache)))
    assert proc.returncode == 0, proc.stderr
    assert "(cached, sha256 ok)" in proc.stderr


def test_no_network_cold_cache_is_one_clear_error(tmp_path):
    cache = tmp_path / "cache"
    out = tmp_path / "d"
    proc = no_traceback(run_build("--out", str(out), env=_no_network_env(cache)))
    assert proc.returncode == 1
    assert "pip could not download" in one_error_line(proc) and "check the network" in proc.stderr
    assert listing(cache) == [] and listing(out) == []


def test_cold_cache_offline_is_one_clear_error(tmp_path):
    proc = no_traceback(run_build("--offline", "--cache-dir", str(tmp_path / "c"), "--out", str(tmp_path / "d")))
    assert proc.returncode == 1 and "--offline forbids downloading it" in one_error_line(proc)


def _in_process_build(upstream_wheel, out, capsys):
    code = cli.main(["--from-wheel", str(upstream_wheel), "--out", str(out), "-q"])
    return code, capsys.readouterr().err


def test_full_output_directory(tmp_path, upstream_wheel, monkeypatch, capsys):
    def full(src, dst, *a, **k):
        with open(dst, "wb") as f:
            f.write(b"x" * 10)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cli, "copy_out", full)
    out = tmp_path / "d"
    code, err = _in_process_build(upstream_wheel, out, capsys)
    assert code == 1 and "No space left on device" in err and "Traceback" not in err
    assert listing(out) == []


def test_unwritable_output_directory(tmp_path, upstream_wheel, monkeypatch, capsys):
    def denied(*a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(cli.tempfile, "NamedTemporaryFile", denied)
    code, err = _in_process_build(upstream_wheel, tmp_path / "d", capsys)
    assert code == 1 and "Cannot write the wheel into" in err and "Permission denied" in err


def _series_copy(tmp_path):
    patches = tmp_path / "patches"
    shutil.copytree(release.PATCHES, patches)
    return patches, patches / f"sglang-{release.default_release()}"


@pytest.mark.parametrize("fault, says", [
    ("missing", "which does not exist"),
    ("duplicated", "twice"),
    ("unlisted", "is not listed in the series"),
    ("no-header", "has no Forwarded:"),
    ("no-default", "names the default release"),
    ("binary-default", "default is not UTF-8 text"),
    ("binary-pin", "pin.toml is not UTF-8 text"),
    ("binary-series", "series is not UTF-8 text"),
    ("binary-patch", ".patch is not UTF-8 text"),
    ("binary-manifest", "upstream.sha256 is not UTF-8 text"),
])
def test_broken_series_is_one_sentence(tmp_path, upstream_wheel, fault, says):
    patches, d = _series_copy(tmp_path)
    first = (d / "series").read_text().split()[0]
    binary = b"\xff\xfe\x00 not text \x80\n"
    if fault.startswith("binary-"):
        what = fault.split("-", 1)[1]
        target = {"default": patches / "default", "pin": d / "pin.toml", "series": d / "series",
                  "patch": d / first, "manifest": d / "upstream.sha256"}[what]
        target.write_bytes(binary + target.read_bytes() if what == "patch" else binary)
    elif fault == "missing":
        (d / first).unlink()
    elif fault == "duplicated":
        (d / "series").write_text((d / "series").read_text() + first + "\n")
    elif fault == "unlisted":
        (d / "extra.patch").write_text((d / first).read_text())
    elif fault == "no-header":
        (d / first).write_text((d / first).read_text().replace("Forwarded: not-needed\n", ""))
    else:
        (patches / "default").unlink()
    out = tmp_path / "d"
    proc = no_traceback(run_build("--patches", str(patches), "--from-wheel", str(upstream_wheel), "--out", str(out)))
    assert proc.returncode == 1 and says in one_error_line(proc)
    assert listing(out) == []


def test_overlay_collision_via_the_build(tmp_path, upstream_wheel, monkeypatch, capsys):
    overlay = tmp_path / "overlay"
    shutil.copytree(release.OVERLAY, overlay)
    (overlay / "sglang" / "srt").mkdir(parents=True, exist_ok=True)
    (overlay / "sglang" / "srt" / "utils").mkdir(exist_ok=True)
    (overlay / "sglang" / "srt" / "utils" / "device_timer.py").write_text("# ours\n")
    monkeypatch.setattr(release, "OVERLAY", overlay)
    code, err = _in_process_build(upstream_wheel, tmp_path / "d", capsys)
    assert code == 1 and "overwrite upstream's sglang/srt/utils/device_timer.py" in err
    assert listing(tmp_path / "d") == []


@pytest.mark.parametrize("argv, says", [
    (["--patches", "/nonexistent-folder"], "no such folder"),
    (["--python-tag", "cp27"], "publishes no wheel for cp27"),
    (["--sglang", "1" * 5000], "'" + "1" * 40 + "...' is not an SGLang release number"),
    (["--sglang", "../../etc"], "'../../etc' is not an SGLang release number"),
    (["--from-wheel", "DIR"], "is a folder; give the wheel file"),
    (["--from-wheel", "/dev/zero"], "/dev/zero is not a regular file"),
    (["--from-wheel", "TEXT"], "is not a wheel (no .whl name, not a zip archive)"),
    (["--into", "SITE", "--sglang", "x" * 5000], "is not an SGLang release number"),
])
def test_contradicting_or_impossible_flags(tmp_path, upstream_wheel, argv, says):
    (tmp_path / "text").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (tmp_path / "site" / "sglang").mkdir(parents=True)
    given = {"W": upstream_wheel, "DIR": tmp_path, "TEXT": tmp_path / "text", "SITE": tmp_path / "site"}
    argv = [str(given.get(a, a)) for a in argv]
    proc = no_traceback(run_build(*argv, "--out", str(tmp_path / "d")))
    assert proc.returncode == 1 and says in one_error_line(proc)


# -- the profiler ---------------------------------------------------------------------------

BACKEND_METHODS = ["new_event", "record", "record_captured", "query", "elapsed", "capturing", "refresh"]


class Faulty(FakeBackend):
    """A fake GPU whose `method` raises, once `method` is set."""

    method = None

    def __getattribute__(self, name):
        if name == object.__getattribute__(self, "method"):
            def boom(*a, **k):
                raise RuntimeError(f"injected into {name}")
            return boom
        return object.__getattribute__(self, name)


def serve(n_cycles, backend):
    """A stand-in for the worker: the hooks in the order the patched code calls them (graph
    capture first); returns the 'tokens' it produced, which must not depend on the profiler."""
    tokens = []
    backend.capture = True
    hooks.P.capture_begin("g", 1)
    for s in range(4):
        hooks.P.draft_step(s)
    backend.capture = False
    hooks.P.capture_end()
    for i in range(n_cycles):
        hooks.P.begin("decode", 1)
        hooks.P.mark("draft_prep")
        hooks.P.draft_replay_begin("g", 1)
        for s in range(4):
            hooks.P.draft_step(s)
        hooks.P.draft_replay_end()
        hooks.P.draft_end()
        hooks.P.graph("draft", True, None)
        hooks.P.mark("verify")
        hooks.P.end()
        tokens.append(i * 3)
        hooks.P.harvest([2])
    return tokens


@pytest.mark.parametrize("method", BACKEND_METHODS)
def test_exception_at_every_hook_point_disables_with_one_warning(method, monkeypatch, caplog):
    b = Faulty()
    monkeypatch.setattr(hooks, "P", Profiler(b, interval=5, clock=b.clock, log_table=False, on_error=hooks.disable))
    monkeypatch.setitem(hooks._state, "warned", False)
    b.method = method
    with caplog.at_level("WARNING", logger="sglang.specprof"):
        got = serve(30, b)
    assert got == list(range(0, 90, 3))
    assert isinstance(hooks.P, NullProfiler), method
    assert len([r for r in caplog.records if "disabled" in r.getMessage()]) == 1


def test_a_stream_check_that_raises_disables_with_one_warning(monkeypatch, caplog):
    """The profiler keeps the backend's `stream_id` (read at each cycle's end): one that raises
    there disables it like any other backend call."""
    b = Faulty()
    b.method = "stream_id"  # before the profiler takes it
    monkeypatch.setattr(hooks, "P", Profiler(b, interval=5, clock=b.clock, log_table=False, on_error=hooks.disable))
    monkeypatch.setitem(hooks._state, "warned", False)
    with caplog.at_level("WARNING", logger="sglang.specprof"):
        got = serve(30, b)
    assert got == list(range(0, 90, 3))
    assert isinstance(hooks.P, NullProfiler)
    assert len([r for r in caplog.records if "disabled" in r.getMessage()]) == 1


def test_jsonl_path_unwritable_at_start_is_an_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "p.jsonl").mkdir()  # a folder where the file should be: cannot be opened for appending
    with pytest.raises(OSError):
        JsonlSink(str(ro / "p.jsonl"))


def test_an_output_path_that_went_bad_before_install_profiles_without_it(tmp_path, monkeypatch, caplog):
    """PATH (or a rank's PATH.rankN) made a folder or a FIFO between the startup check and the
    worker's install: that rank profiles without its JSONL, one warning naming the file."""
    import types

    class Backend(FakeBackend):
        kind = "fake"

    path = tmp_path / "p.jsonl"
    path.mkdir()
    args = types.SimpleNamespace(speculative_profile=True, speculative_algorithm="EAGLE3", speculative_num_steps=3,
                                 speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                                 speculative_profile_interval=100, speculative_profile_output=str(path), tp_size=1)
    monkeypatch.setitem(sys.modules, "sglang.specprof.cuda_backend", types.SimpleNamespace(CudaBackend=Backend))
    monkeypatch.setattr(hooks, "P", hooks.P)
    with caplog.at_level("WARNING", logger="sglang.specprof"):
        hooks.install(args, 0, "v2")
    try:
        assert hooks.P.enabled and not any(isinstance(s, JsonlSink) for s in hooks.P.sinks)
        (rec,) = caplog.records
        assert rec.getMessage() == f"speculative profile: no JSONL, {path} cannot be appended to (not a regular file)."
    finally:
        hooks.P.close()


WRITER = r'''
import json, sys
sys.path.insert(0, sys.argv[2])
from sglang.specprof.jsonl import JsonlSink
sink = JsonlSink(sys.argv[1])
window = json.loads(open(sys.argv[3]).readline())
window["pad"] = "x" * 200000  # long lines, so the kill is likely to land inside one
i = 0
while True:
    sink(dict(window, window=i))
    i += 1
'''


def test_killed_while_writing_leaves_no_torn_line_unreported(tmp_path):
    path = tmp_path / "p.jsonl"
    sample = ROOT / "tests" / "data" / "profile-0.5.12-eagle3-v2-topk1.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(ROOT / "overlay"), str(sample)])
    deadline = time.time() + 20
    while (not path.exists() or path.stat().st_size < 2_000_000) and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    data = path.read_text()
    lines = data.split("\n")
    complete = lines[:-1]
    assert len(complete) >= 5
    for n, line in enumerate(complete, 1):
        obj = json.loads(line)  # every finished line is whole JSON
        assert obj["window"] == n - 1
    # the reader either sees a clean end or names the cut line, and can skip it
    windows, notes = schema.read(str(path), skip_torn=True)
    assert len(windows) == len(complete)
    if lines[-1]:
        assert notes == [f"{path} line {len(lines)} is cut short (the server stopped mid-write); skipped."]
        with pytest.raises(schema.ProfileError, match=f"line {len(lines)} is not JSON"):
            schema.read(str(path))


# -- the JSONL writer on the server ---------------------------------------------------------

def _windows(n, start=0, pad=1000):
    return [{"window": i, "pad": "x" * pad} for i in range(start, start + n)]


def _lines(path):
    return path.read_bytes().decode().split("\n")


def test_a_short_write_is_taken_back_and_a_restart_starts_a_fresh_line(tmp_path, monkeypatch, caplog):
    """A full disk: the part of a line written is taken back (no torn line stays); a file cut
    by a kill mid-write: the next server's first line starts on a fresh one."""
    from sglang.specprof import jsonl

    path = tmp_path / "p.jsonl"
    sink = JsonlSink(str(path))
    for w in _windows(2):
        sink(w)
    real = os.write

    def half(fd, data):
        return real(fd, data[: len(data) // 2])

    with caplog.at_level("WARNING", logger="sglang.specprof"), monkeypatch.context() as m:
        m.setattr(jsonl.os, "write", half)
        sink({"window": 2, "pad": "x" * 1000})
    assert sink.broken and [json.loads(l)["window"] for l in _lines(path)[:-1]] == [0, 1]
    assert path.read_bytes().endswith(b"\n")
    assert len([r for r in caplog.records if "cannot append" in r.getMessage()]) == 1
    with open(path, "ab") as f:
        f.write(b'{"window":2,"pa')  # killed mid-write
    again = JsonlSink(str(path))
    again({"window": 3})
    lines = _lines(path)
    assert lines[2] == '{"window":2,"pa' and json.loads(lines[3]) == {"window": 3} and lines[4] == ""


def test_the_output_replaced_by_a_fifo_while_serving_does_not_block(tmp_path, caplog):
    import threading

    path = tmp_path / "p.jsonl"
    sink = JsonlSink(str(path))
    sink({"window": 0})
    path.unlink()
    os.mkfifo(path)
    t = threading.Thread(target=sink, args=({"window": 1},), daemon=True)
    with caplog.at_level("WARNING", logger="sglang.specprof"):
        t.start()
        t.join(5)
    blocked = t.is_alive()
    if blocked:  # let the writer's open return, so the thread ends
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        t.join(5)
        os.close(fd)
    assert not blocked and sink.broken
    (rec,) = [r for r in caplog.records if "cannot append" in r.getMessage()]
    assert f"{path} (not a regular file)" in rec.getMessage()


@pytest.mark.parametrize("raw", ["nan", "inf", "1e400", "-1", "0.0000001", "-inf", "lots"])
def test_an_output_cap_that_is_no_size_is_one_warning_and_the_default(raw, monkeypatch, caplog):
    from sglang.specprof import jsonl

    monkeypatch.setenv("SGLANG_SPECPROF_OUTPUT_MAX_MB", raw)
    with caplog.at_level("WARNING", logger="sglang.specprof"):
        assert jsonl.max_bytes_from_env() == jsonl.DEFAULT_MAX_MB << 20
    (rec,) = caplog.records
    assert rec.getMessage().startswith("speculative profile: SGLANG_SPECPROF_OUTPUT_MAX_MB=") and "\n" not in rec.getMessage()
    for ok, got in (("0", 0), ("2", 2 << 20), ("1.5", 3 << 19), ("", jsonl.DEFAULT_MAX_MB << 20)):
        monkeypatch.setenv("SGLANG_SPECPROF_OUTPUT_MAX_MB", ok)
        assert jsonl.max_bytes_from_env() == got
    assert len(caplog.records) == 1


def test_two_servers_on_one_path_rotate_without_stopping(tmp_path, monkeypatch, caplog):
    """The other server renamed PATH to PATH.1 between this one's open and its rename: this
    one takes the new PATH and goes on."""
    from sglang.specprof import jsonl

    path = tmp_path / "p.jsonl"
    a, b = JsonlSink(str(path), max_bytes=20_000), JsonlSink(str(path), max_bytes=20_000)
    for w in _windows(19):
        a(w)
    real = os.replace

    def raced(src, dst):
        monkeypatch.setattr(jsonl.os, "replace", real)
        real(src, dst)  # the other server's rotation
        real(src, dst)

    monkeypatch.setattr(jsonl.os, "replace", raced)
    with caplog.at_level("WARNING", logger="sglang.specprof"):
        b({"window": 19, "pad": "x" * 1000})  # past the cap: b rotates, and finds PATH gone
        a({"window": 20, "pad": "x" * 1000})
    assert not a.broken and not b.broken and caplog.records == []
    assert [json.loads(l)["window"] for l in _lines(path)[:-1]] == [19, 20]
    assert len(_lines(tmp_path / "p.jsonl.1")) == 20


@pytest.mark.parametrize("culprit", ["folder", "immutable"])
def test_a_rotation_that_fails_names_path_1_and_path_goes_on(culprit, tmp_path, monkeypatch, caplog):
    from sglang.specprof import jsonl

    path = tmp_path / "p.jsonl"
    if culprit == "folder":
        (tmp_path / "p.jsonl.1").mkdir()
        (tmp_path / "p.jsonl.1" / "x").write_text("")
    else:  # chattr +i needs root: its error, as the kernel gives it
        def refused(src, dst):
            raise PermissionError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(jsonl.os, "replace", refused)
    sink = JsonlSink(str(path), max_bytes=20_000)
    with caplog.at_level("WARNING", logger="sglang.specprof"):
        for w in _windows(50):
            sink(w)
    assert not sink.broken and sink.rotations == 0
    assert [json.loads(l)["window"] for l in _lines(path)[:-1]] == list(range(50))
    (rec,) = caplog.records
    assert rec.getMessage().startswith(f"speculative profile: cannot rename {path} to {path}.1 (")
