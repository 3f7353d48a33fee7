#!/usr/bin/env python3
"""Build sglang-X.Y.Z+specprof.N: see README.md, or python build.py --help."""
import sys

from specprof_build.cli import main

if __name__ == "__main__":
    sys.exit(main())
