"""Fuzzing the parsers: any input gives a result or one clear error, never a traceback."""
import json
import string

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fakes import FakeBackend  # noqa: F401  (puts overlay/ on the path)
from specprof_build import cli, rebase, release
from specprof_build.errors import BuildError
from sglang_specprof import schema

EXAMPLES = 300
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

FLAGS = ["--sglang", "--list", "--check", "--from-wheel", "--python-tag", "--platform", "--out", "--cache-dir",
         "--offline", "--patches", "-q", "--quiet", "--help", "rebase", "--onto", "--from", "--continue", "--abort",
         "--accept-hook-moves", "check", "list", "into", "restore", "upstream", "0.5.12", "0.5.13", "cp312", "manylinux_2_34_aarch64", "x", "", "--", "-"]
words = st.one_of(st.sampled_from(FLAGS), st.text(string.printable, max_size=12))


@FUZZ
@given(argv=st.lists(words, max_size=8))
def test_command_line(argv, tmp_path, monkeypatch, capsys):
    def offline(version, timeout=30):
        raise BuildError("offline in this test")

    monkeypatch.setattr(rebase, "published_pin", offline)
    monkeypatch.setattr(rebase, "WORK", tmp_path / "work")
    # never touch the network, the real cache or dist/
    safe = argv + ["--offline", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out")]
    if argv[:1] == ["rebase"]:
        safe = argv + ["--cache-dir", str(tmp_path / "cache")]
    try:
        code = cli.main(safe)
    except SystemExit as e:  # argparse: usage errors exit 2, --help exits 0
        code = e.code
    assert code in (0, 1, 2)
    assert "Traceback" not in capsys.readouterr().err


@FUZZ
@given(text=st.text(max_size=400))
def test_series_file(text):
    try:
        names = release.parse_series(text)
    except BuildError as e:
        assert str(e).startswith("series line ")
    else:
        assert all(n.endswith(".patch") and "/" not in n for n in names)


pin_lines = st.lists(st.one_of(
    st.sampled_from(['version = "0.5.12"', 'revision = 1', 'revision = 0', 'revision = "1"', "[artifacts]",
                     '"sglang-0.5.12-cp311-cp311-manylinux_2_34_x86_64.whl" = "' + "a" * 64 + '"',
                     '"sglang-0.5.13-x.whl" = "' + "b" * 64 + '"', 'version = "not a version"', "[other]",
                     'note = "x"', 'version = 5', "artifacts = 3"]),
    st.text(max_size=40)), max_size=8)


@FUZZ
@given(lines=pin_lines)
def test_pin_file(lines):
    text = "\n".join(lines)
    try:
        pin = release.parse_pin(text)
    except BuildError as e:
        assert str(e).startswith("pin.toml")
    else:
        assert pin.revision >= 1 and pin.artifacts
        assert release.parse_pin(release.format_pin(pin)) == pin


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=20)


@FUZZ
@given(text=st.one_of(st.text(max_size=300), json_values.map(json.dumps)))
def test_profile_line(text):
    try:
        obj = schema.parse_line(text, "line 7")
    except schema.ProfileError as e:
        assert str(e).startswith("line 7 ")
    else:
        assert obj["schema"] == schema.SCHEMA


with open(release.ROOT / "tests" / "data" / "profile-0.5.12-eagle3-v2-topk1.jsonl") as f:
    WINDOW = json.loads(f.readline())


def _paths(obj, prefix=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))


PATHS = list(_paths(WINDOW))


def _broken(base, path, value, delete):
    """A copy of `base` with the field at `path` replaced by `value`, or deleted."""
    obj = json.loads(json.dumps(base))
    node = obj
    for k in path[:-1]:
        node = node[k]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return obj


@FUZZ
@given(path=st.sampled_from(PATHS), value=json_values, delete=st.booleans())
def test_profile_window_with_one_field_broken(path, value, delete):
    obj = _broken(WINDOW, path, value, delete)
    try:
        schema.parse_line(json.dumps(obj), "line 1")
    except schema.ProfileError as e:
        assert str(e).startswith("line 1 ")


def _kernel_window():
    import lzma

    path = release.ROOT / "tests" / "data" / "kernels" / "0.5.16-exact-b" / "profile-s3k1.jsonl.xz"
    for line in lzma.decompress(path.read_bytes()).decode().splitlines():
        w = json.loads(line)
        if w.get("kernels"):
            return w


KWINDOW = _kernel_window()
KPATHS = list(_paths(KWINDOW))


def _report_end_to_end(obj, tmp_path):
    """What `sglang-specprof report --json --trace` and `compare` do with a file of one window:
    a result, or one sentence (ProfileError, SourceError), never another exception."""
    from sglang_specprof import compare, report
    from sglang_specprof.trace import trace

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(obj) + "\n")
    try:
        windows, _ = report.load(str(path))
    except (schema.ProfileError, report.SourceError) as e:
        assert "\n" not in str(e)
        return
    summary = report.summarize(windows)
    advice = report.advise(summary)
    json.dumps({"summary": summary, "advice": advice}, allow_nan=False)  # strict JSON always
    report.render(summary, advice)
    json.dumps(trace(windows), allow_nan=False)
    json.dumps(compare.compare(windows, windows), allow_nan=False)
    compare.format_compare(compare.compare(windows, windows), "a", "b")


@FUZZ
@given(which=st.sampled_from(["plain", "kernels"]), data=st.data(), value=json_values, delete=st.booleans())
def test_report_end_to_end_on_a_window_with_one_field_broken(which, data, value, delete, tmp_path):
    base, paths = (WINDOW, PATHS) if which == "plain" else (KWINDOW, KPATHS)
    _report_end_to_end(_broken(base, data.draw(st.sampled_from(paths)), value, delete), tmp_path)


def test_a_gpu_time_below_zero_gets_no_advice_and_strict_json(tmp_path):
    """Found by the test above: a phase's mean of -15 ms made the advisor divide by a cycle of
    no time (NaN in its bounds, which strict JSON refuses). A damaged bucket gets no advice,
    and a step count whose predicted cycle takes no time is left out."""
    from sglang_specprof import advisor, report

    key = next(iter(WINDOW["buckets"]))
    phase = next(iter(WINDOW["buckets"][key]["phases"]))
    obj = _broken(WINDOW, ("buckets", key, "phases", phase, "gpu_ms", "mean"), -15, False)
    _report_end_to_end(obj, tmp_path)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(obj) + "\n")
    windows, _ = report.load(str(path))
    assert key not in report.advise(report.summarize(windows))
    path.write_text(json.dumps(WINDOW) + "\n")  # the same window whole: advised
    assert key in report.advise(report.summarize(report.load(str(path))[0]))
    zero = advisor.Inputs(steps=3, batch=1.0, phases={"draft": 1.0}, between_ms=0.0, wall_ms=None,
                          step_ms=[0.5, 0.5, 0.5], per_position=[0.8, 0.6, 0.4])
    adv = advisor.predict(zero)  # at 1 step the draft's 1 ms less 2 steps of 0.5: no time left
    assert adv is not None and 1 not in [r["steps"] for r in adv["rows"]] and 3 in [r["steps"] for r in adv["rows"]]
    json.dumps(adv, allow_nan=False)
    assert advisor.predict(advisor.Inputs(steps=3, batch=1.0, phases={}, between_ms=0.0, wall_ms=None, step_ms=[],
                                          per_position=[0.8])) is None


@pytest.mark.parametrize("text, says", [
    ('{"schema": "sglang-specprof/2", "seconds": NaN}', "holds NaN"),
    ('{"schema": "sglang-specprof/2", "seconds": Infinity}', "holds Infinity"),
    ("[" * 100000 + "]" * 100000, "nested too deep"),
])
def test_lines_no_profile_writes_are_one_sentence(text, says):
    with pytest.raises(schema.ProfileError, match=says):
        schema.parse_line(text, "line 3")


def test_ill_typed_fields_and_odd_server_answers_are_one_sentence(tmp_path, monkeypatch, capsys):
    import io

    from sglang_specprof import cli as report_cli, report, source

    obj = json.loads(json.dumps(WINDOW))
    key = next(iter(obj["buckets"]))
    obj["buckets"][key]["cycle_gpu_ms"]["mean"] = "x"
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(obj) + "\n")
    assert report_cli.main(["report", str(path), "--json"]) == 1
    err = capsys.readouterr().err
    assert "holds a value the report cannot use" in err and "Traceback" not in err
    for answer in (b"[1, 2]", b'"up"', b'{"internal_states": [{"speculative_profile": {"latest": {"schema": 3}}}]}'):
        monkeypatch.setattr(source.urllib.request, "urlopen", lambda url, timeout=None, a=answer: io.BytesIO(a))
        with pytest.raises(report.SourceError) as e:
            report.load("http://127.0.0.1:1")
        assert "\n" not in str(e.value)
