"""report --plot's colours and layout, and report --html's page (in a headless browser where one is installed)."""

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from fakes import FakeBackend  # noqa: F401  (puts overlay/ on the path)
from sglang_specprof import advisor, cli, kernels, page, report, schema

DATA = Path(__file__).resolve().parent / "data"
V2 = DATA / "profile-0.5.12-eagle3-v2-topk1.jsonl"
ADAPTIVE = DATA / "adaptive" / "0.5.16-m3" / "profile.jsonl.xz"  # 16 buckets, one of them 4 cycles
CLOSED_LOOP = DATA / "adaptive" / "0.5.16-closed-loop" / "profile.jsonl.xz"  # 31 buckets, switches of step count
KERNELS = DATA / "kernels" / "0.5.16-exact" / "profile-s3k1.jsonl.xz"


def run_cli(*argv, capsys):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _summary(path):
    return report.summarize(report.load(str(path))[0])


def _phase_bars(fig):
    """{phase: {facecolours}} and {bucket label: [axes]} from a figure's objects."""
    from sglang_specprof import plot

    colours, axes_of = {}, {}
    for ax in fig.get_axes():
        for c in ax.containers:
            name = c.get_label()
            if name in plot.PHASE_COLOURS or name == plot.BETWEEN:
                colours.setdefault(name, set()).update(tuple(p.get_facecolor()) for p in c.patches)
        for t in ax.get_xticklabels():
            if t.get_text().startswith("bs "):
                axes_of.setdefault(t.get_text()[3:], []).append(ax)
    return colours, axes_of


def test_each_phase_has_one_fixed_colour_in_every_figure_and_warmup_buckets_are_drawn_apart():
    pytest.importorskip("matplotlib")
    import matplotlib.colors
    import matplotlib.pyplot as plt

    from sglang_specprof import plot

    assert list(plot.PHASE_COLOURS) == list(schema.PHASES)  # a colour for each phase the schema names
    fixed = dict(plot.PHASE_COLOURS, **{plot.BETWEEN: plot.BETWEEN_COLOUR})
    assert len(set(fixed.values())) == len(fixed)
    seen: dict = {}
    figs = []
    for path in (ADAPTIVE, V2, KERNELS):
        summary = _summary(path)
        whole, drawn = plot.figure(summary, plt)
        apart, _ = plot.figures(summary, plt)
        figs += [whole] + [f for _, f in apart]
        for fig in [whole] + [f for _, f in apart]:
            colours, _ = _phase_bars(fig)
            for name, cs in colours.items():
                seen.setdefault(name, set()).update(cs)
        if path == ADAPTIVE:
            assert drawn["warmup"] == ["5-8@5"] and len(drawn["buckets"]) == 15
            for fig in [whole, apart[0][1], apart[1][1], apart[2][1]]:
                _, axes_of = _phase_bars(fig)
                warm_axes = axes_of["5-8@5"]
                assert warm_axes  # drawn, and on axes of its own
                for key in drawn["buckets"]:
                    assert not set(map(id, axes_of[key])) & set(map(id, warm_axes)), key
            # the 4-cycle bucket (250 ms p99) no longer sets the others' scale: theirs are 6-15 ms
            _, axes_of = _phase_bars(apart[0][1])
            assert axes_of["1@1"][0].get_ylim()[1] < 20 and axes_of["5-8@5"][0].get_ylim()[1] > 200
            assert apart[0][1].get_figwidth() > 10  # wide enough for 16 buckets, their labels turned
            assert all(t.get_rotation() == 45 for t in axes_of["1@1"][0].get_xticklabels())
    for fig in figs:
        plt.close(fig)
    assert len(seen) >= 12
    for name, cs in seen.items():
        assert cs == {matplotlib.colors.to_rgba(fixed[name])}, name  # one colour everywhere, the fixed one
    assert len({next(iter(cs)) for cs in seen.values()}) == len(seen)  # no two phases share one


def test_phases_the_schema_does_not_name_get_distinct_stable_colours():
    from sglang_specprof import plot

    names = [f"phase {i}" for i in range(40)] + ["verify", plot.BETWEEN]
    a = plot.phase_colours(names)
    assert len(set(a.values())) == len(names) and a["verify"] == plot.PHASE_COLOURS["verify"]
    assert not set(a[n] for n in names[:40]) & (set(plot.PHASE_COLOURS.values()) | {plot.BETWEEN_COLOUR})
    assert plot.phase_colours(["phase 3"])["phase 3"] == plot.phase_colours(["phase 3", "x"])["phase 3"]


class _Dom(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.imgs, self.ids, self.text = [], [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if tag == "img":
            self.imgs.append(a)
        if "id" in a:
            self.ids.append(a["id"])

    def handle_data(self, data):
        self.text.append(data)


def _dom(text):
    d = _Dom()
    d.feed(text)
    return d


def _svg_of(img):
    src = img["src"]
    assert src.startswith("data:image/svg+xml;base64,")
    return ET.fromstring(base64.b64decode(src.split(",", 1)[1]))


@pytest.mark.parametrize("path,panels", [(ADAPTIVE, 3), (CLOSED_LOOP, 3), (KERNELS, 4)])
def test_html_page_holds_every_bucket_table_line_and_figure(tmp_path, capsys, path, panels):
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.html"
    code, text, err = run_cli("report", str(path), "--html", str(out), capsys=capsys)
    assert code == 0 and f"page in {out}" in err
    html = out.read_text()
    dom = _dom(html)
    summary = _summary(path)
    advice = report.advise(summary)
    buckets = [k for k, b in summary["buckets"].items() if b["cycles"]]
    # every figure, each an SVG image inside the page
    assert len(dom.imgs) == panels and all(_svg_of(i).tag.endswith("svg") for i in dom.imgs)
    assert "script" not in dom.tags and "link" not in dom.tags and "http://" not in html.replace(
        "http://www.w3.org", "")
    # the bucket table: a row per bucket, then a section (phase table, advisor) per bucket
    assert "buckets" in dom.ids and dom.tags.count("table") >= 1 + len(buckets)
    body = "".join(dom.text)
    for key in buckets:
        assert f"bs {key}: {summary['buckets'][key]['cycles']} cycles" in body
    for key, adv in advice.items():  # the advisor's lines, with their ranges
        assert f"bs {key} " + advisor.format_advice(adv) in body
    assert text.strip() in body  # and all the text report prints
    if path == ADAPTIVE:
        assert "by-steps" in dom.ids and "5-8@5 (warm-up)" in body
    if path == CLOSED_LOOP:  # the switches; the figures' 24 buckets of 31, said
        assert "by-steps" in dom.ids and report.format_switches(summary)[0] in body
        left = f"{len(buckets) - 24} of {len(buckets)} batch-size buckets (those with the fewest cycles)"
        assert len(buckets) > 24 and f"The figures leave out {left}." in body
    if path == KERNELS:
        assert kernels.format_block(summary["kernels"])[0] in body


def test_html_escapes_the_profiles_strings(tmp_path, capsys):
    """A setting or a phase name holding markup is shown as text: no element, no script."""
    pytest.importorskip("matplotlib")
    windows = [json.loads(x) for x in V2.read_text().splitlines() if x.strip()][:3]
    for w in windows:
        w["config"]["algorithm"] = "<script>alert(1)</script>"
        w["config"]["worker"] = "v2\" onload=\"alert(2)"
        for bk in w["buckets"].values():
            bk["phases"]["<img src=x onerror=alert(3)>"] = bk["phases"].pop("verify")
    p = tmp_path / "evil.jsonl"
    p.write_text("".join(json.dumps(w) + "\n" for w in windows))
    out = tmp_path / "evil <b>.html"
    code, _, err = run_cli("report", str(p), "--html", str(out), capsys=capsys)
    html = out.read_text()
    dom = _dom(html)
    assert code == 0 and "<script" not in html.lower() and "<img src=x" not in html
    assert "script" not in dom.tags and len(dom.imgs) == 3 and all("onerror" not in i for i in dom.imgs)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "&lt;img src=x onerror=alert(3)&gt;" in html
    assert "<script>alert(1)</script>" in "".join(dom.text)  # shown as the text it is


def test_a_bucket_name_holding_markup_is_refused_before_any_page(tmp_path, capsys):
    """Bucket names are read as batch sizes ("5-8@3"): one that is not is refused in one sentence."""
    w = json.loads(V2.read_text().splitlines()[0])
    w["buckets"]["<script>alert(1)</script>"] = w["buckets"].pop("1")
    p = tmp_path / "evil.jsonl"
    p.write_text(json.dumps(w) + "\n")
    code, _, err = run_cli("report", str(p), "--html", str(tmp_path / "r.html"), capsys=capsys)
    assert code == 1 and err.count("\n") == 1 and not (tmp_path / "r.html").exists()


def test_html_without_matplotlib_says_so_in_the_page(tmp_path, capsys, monkeypatch):
    for mod in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, mod, None)  # import matplotlib: ImportError, as where it is missing
    out = tmp_path / "r.html"
    code, _, err = run_cli("report", str(ADAPTIVE), "--html", str(out), capsys=capsys)
    html = out.read_text()
    dom = _dom(html)
    assert code == 0 and f"page in {out}" in err and not dom.imgs
    assert "The figures need matplotlib, which is not installed here: pip install matplotlib" in html
    assert "buckets" in dom.ids and "bs 17-32@5: 1460 cycles" in "".join(dom.text)
    code, _, err = run_cli("report", str(ADAPTIVE), "--plot", str(tmp_path / "f.png"), capsys=capsys)
    assert code == 1 and err.count("\n") == 1 and "--plot needs matplotlib" in err


def test_an_unwritable_html_path_is_one_sentence_and_writes_nothing(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "no" / "r.html", tmp_path / "file" / "r.html"):
        code, out, err = run_cli("report", str(V2), "--html", str(bad), capsys=capsys)
        assert code == 1 and err.count("\n") == 1 and f"error: cannot write {bad}:" in err and "Traceback" not in err
        assert not bad.exists()
    # a failure at the rename (a full disk, a quota) leaves the page there before untouched, and no part of it
    old = tmp_path / "r.html"
    old.write_text("the page before")

    def fail(a, b):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(page.os, "replace", fail)
    code, _, err = run_cli("report", str(V2), "--html", str(old), capsys=capsys)
    assert code == 1 and "cannot write" in err and "No space left on device" in err and err.count("\n") == 1
    assert old.read_text() == "the page before" and sorted(os.listdir(tmp_path)) == ["file", "r.html"]
    monkeypatch.undo()
    code, _, _ = run_cli("report", str(V2), "--html", str(old), capsys=capsys)
    assert code == 0 and old.read_text().startswith("<!DOCTYPE html>")
    # the page is not the profile, nor another output's file
    code, _, err = run_cli("report", str(V2), "--html", str(V2), capsys=capsys)
    assert code == 1 and "--html" in err and "is the profile being read" in err


BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _browser():
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def _headless(browser, page_path, tmp_path):
    """(the DOM after load, the console messages logged) of a file:// page."""
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
                           "--dump-dom", page_path.as_uri()], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, [x for x in proc.stderr.splitlines() if ":CONSOLE" in x]


def test_html_page_renders_in_a_headless_browser_without_console_errors(tmp_path, capsys):
    browser = _browser()
    if browser is None:
        pytest.skip(f"no headless browser on PATH ({', '.join(BROWSERS)})")
    pytest.importorskip("matplotlib")
    # the check sees what a page logs: one that logs an error and breaks its policy is caught
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><head><meta http-equiv=Content-Security-Policy content=\"default-src "
                   "'none'\"></head><body><table></table><script>console.error('x')</script></body></html>")
    _, logged = _headless(browser, bad, tmp_path)
    assert logged
    for path, panels in ((ADAPTIVE, 3), (KERNELS, 4)):
        out = tmp_path / f"{path.parent.name}.html"
        code, _, _ = run_cli("report", str(path), "--html", str(out), capsys=capsys)
        assert code == 0
        dom, logged = _headless(browser, out, tmp_path)
        assert logged == []  # no console error, no policy broken
        assert len(re.findall(r"<img\b", dom)) == panels and len(re.findall(r"<svg\b", dom)) == 0
        assert re.search(r"<table[^>]*id=\"buckets\"", dom) and dom.count("<table") >= 1 + panels
        summary = _summary(path)
        for key, b in summary["buckets"].items():
            if b["cycles"]:
                assert f"bs {key}: {b['cycles']} cycles" in dom
