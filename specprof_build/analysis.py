"""The analysis package alone, as a pure-Python wheel: `sglang_specprof-V-py3-none-any.whl`.

For reading profiles where SGLang is not installed (a laptop): the same `sglang-specprof`
command, no torch, no SGLang, nothing to resolve; matplotlib comes with the `plot` extra.
It holds the files the sglang-X.Y.Z+specprof.N wheel already has under sglang_specprof/, so
an environment takes one of the two, not both.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

from . import release, repack

NAME = "sglang_specprof"
PACKAGE = release.OVERLAY / NAME


def version() -> str:
    """The project's version (pyproject.toml), which the analysis package shares."""
    with open(release.ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


METADATA = """\
Metadata-Version: 2.1
Name: sglang-specprof
Version: {version}
Summary: Read, report and compare the profiles of sglang-specprof's --speculative-profile (no SGLang, no torch)
License: Apache-2.0
Requires-Python: >=3.10
Provides-Extra: plot
Requires-Dist: matplotlib>=3.7; extra == "plot"
"""

WHEEL = """\
Wheel-Version: 1.0
Generator: sglang-specprof build.py
Root-Is-Purelib: true
Tag: py3-none-any
"""


def build_wheel(work: Path) -> Path:
    """Write the analysis wheel under `work` (byte-reproducible, as the sglang one)."""
    v = version()
    tree = Path(work) / f"{NAME}-{v}"
    shutil.copytree(PACKAGE, tree / NAME, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    info = tree / f"{NAME}-{v}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(METADATA.format(version=v))
    (info / "WHEEL").write_text(WHEEL)
    (info / "entry_points.txt").write_text(f"[console_scripts]\n{repack.CONSOLE_SCRIPT}\n")
    (info / "top_level.txt").write_text(f"{NAME}\n")
    repack.check_compiles(tree, [str(p.relative_to(tree)) for p in (tree / NAME).rglob("*.py")])
    repack.normalize_modes(tree)
    staged = Path(work) / "analysis-out"
    staged.mkdir()
    return repack.pack(tree, staged, None)
