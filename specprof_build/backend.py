"""The build backend: setuptools', after refusing an interpreter below 3.11 in one sentence
(pyproject.toml names it; `pip install -e .` runs it before resolving any dependency)."""
import sys

from specprof_build.pyversion import too_old

if too_old():
    print(too_old(), file=sys.stderr)
    sys.exit(1)

from setuptools.build_meta import *  # noqa: E402,F401,F403  (the hooks pip calls)
