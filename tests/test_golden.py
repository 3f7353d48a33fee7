"""Every recorded profile replays to the same output, byte for byte: `report` (text and --json),
`report --html` of a few, `compare` of a few pairs, and the server log's table of each
profile's last window (with the live advice, and with the table's own).

The outputs are in tests/data/golden/: a small one as its text, a larger one as its sha256.
After a change that is meant to change an output, write them again with

    PYTHONPATH=overlay .venv/bin/python tests/test_golden.py --write

and read the diff of the small ones; `--show NAME` prints one case's output now.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "data" / "golden"
MANIFEST = GOLDEN / "manifest.json"
INLINE = 4096  # an output up to this many bytes is kept as its text, a larger one as its sha256

sys.path.insert(0, str(ROOT / "overlay"))


def profiles() -> list[str]:
    """The recorded profiles, as paths from the repository's root (what the outputs name)."""
    found = sorted(p for p in (ROOT / "tests" / "data").rglob("*.jsonl*") if "golden" not in p.parts)
    found += sorted((ROOT / "bench" / "results" / "profiles").glob("*.jsonl*"))
    return [str(p.relative_to(ROOT)) for p in found]


HTML = ("tests/data/profile-0.5.12-eagle3-v1-topk2.jsonl", "tests/data/adaptive/0.5.16-m4/profile.jsonl.xz",
        "tests/data/kernels/0.5.16-exact/profile-s3k1.jsonl.xz", "tests/data/exact/0.5.16-a/profile-s1k1.jsonl.xz")
PAIRS = (("tests/data/exact/0.5.16-a/profile-s1k1.jsonl.xz", "tests/data/exact/0.5.16-a/profile-s8k1.jsonl.xz"),
         ("tests/data/exact/0.5.12/profile-s3k1.jsonl.xz", "tests/data/exact/0.5.16-b/profile-s3k1.jsonl.xz"),
         ("tests/data/adaptive/0.5.16-m3/profile.jsonl.xz", "tests/data/adaptive/0.5.16-m4/profile.jsonl.xz"),
         ("tests/data/kernels/0.5.16-exact/profile-s3k1.jsonl.xz",
          "tests/data/kernels/0.5.16-exact/profile-s3k4.jsonl.xz"),
         ("bench/results/profiles/advisor-0.5.12-acc2.5-steps5.jsonl.xz",
          "bench/results/profiles/advisor-0.5.12-acc4.0-steps5.jsonl.xz"),
         ("tests/data/zero-step/0.5.16-h100/profile-spec.jsonl.xz",
          "tests/data/zero-step/0.5.16-h100/profile-plain.jsonl.xz"))


def cases() -> dict:
    """{name: how to make its output}: ("cli", argv) or ("log", profile)."""
    out = {}
    for p in profiles():
        out[f"report {p}"] = ("cli", ["report", p])
        out[f"report --json {p}"] = ("cli", ["report", p, "--json"])
        out[f"log {p}"] = ("log", p)
    for p in HTML:
        out[f"report --html {p}"] = ("html", p)
    for a, b in PAIRS:
        out[f"compare {a} {b}"] = ("cli", ["compare", a, b])
        out[f"compare --json {a} {b}"] = ("cli", ["compare", a, b, "--json"])
    return out


def _cli(argv: list[str]) -> str:
    from sglang_specprof import cli

    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        rc = cli.main(argv)
    return f"{o.getvalue()}--- stderr ---\n{e.getvalue()}--- rc {rc}\n"


def _log(profile: str) -> str:
    """The server log's table of the profile's last window: with the live advice (what the
    server prints), and predicted by the table alone (a caller that passes no advice)."""
    from sglang_specprof import advisor, schema, table

    last = None
    for w in schema.iter_windows(profile, skip_torn=True, drop_repeats=True):
        last = w
    return (table.format_summary(last, advice=advisor.window_advice(last)) + "\n--- without advice ---\n"
            + table.format_summary(last) + "\n")


def _html(profile: str, tmp: Path) -> str:
    """The page without its figures (what matplotlib draws differs from one release of it to another)."""
    from sglang_specprof import page

    out = tmp / "page.html"
    drawn, page.svg_figures = page.svg_figures, lambda summary: (None, "(the figures)")
    try:
        text = _cli(["report", profile, "--html", str(out)]).replace(str(out), "PAGE")
    finally:
        page.svg_figures = drawn
    return text + out.read_text()


def render(kind: str, arg, tmp: Path) -> str:
    cwd = os.getcwd()
    os.chdir(ROOT)  # the outputs name the profiles as given, from the repository's root
    try:
        if kind == "cli":
            return _cli(arg)
        if kind == "log":
            return _log(arg)
        return _html(arg, tmp)
    finally:
        os.chdir(cwd)


def entry(text: str) -> dict:
    data = text.encode()
    if len(data) <= INLINE:
        return {"text": text}
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _manifest() -> dict:
    return json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}


def test_the_cases_are_the_recorded_ones():
    assert sorted(_manifest()) == sorted(cases()), "a profile was added or removed: write the golden outputs again"


@pytest.mark.parametrize("name", sorted(cases()))
def test_replays_byte_for_byte(name, tmp_path):
    want = _manifest().get(name)
    if want is None:
        pytest.fail(f"no golden output for {name!r}: write them with tests/test_golden.py --write")
    kind, arg = cases()[name]
    got = entry(render(kind, arg, tmp_path))
    assert got == want, f"{name} renders otherwise than it did (tests/test_golden.py --show '{name}')"


def main(argv: list[str]) -> int:
    import tempfile

    if argv[:1] == ["--show"]:
        with tempfile.TemporaryDirectory() as tmp:
            kind, arg = cases()[argv[1]]
            sys.stdout.write(render(kind, arg, Path(tmp)))
        return 0
    if argv != ["--write"]:
        print(__doc__)
        return 2
    GOLDEN.mkdir(parents=True, exist_ok=True)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (kind, arg) in sorted(cases().items()):
            out[name] = entry(render(kind, arg, Path(tmp)))
    MANIFEST.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"{len(out)} golden outputs in {MANIFEST.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
