#!/usr/bin/env python3
"""Build sglang-X.Y.Z+specprof.N: see README.md, or python build.py --help."""
import sys

from specprof_build.pyversion import too_old

if __name__ == "__main__" and too_old():  # before the modules that need 3.11 are imported
    print("build.py: error: %s" % too_old(), file=sys.stderr)
    sys.exit(1)

from specprof_build.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
