"""The interpreter check, in syntax any Python 3 reads: build.py and the install of this
project (its build backend) refuse an interpreter below 3.11 in one sentence, before
anything that needs 3.11 is imported (pip's own Requires-Python check comes only after it has
resolved the test extras, and on pip 23.0 that resolution backtracks for many minutes)."""
import sys

MIN = (3, 11)


def too_old(version_info=None):
    """The sentence for an interpreter below MIN (this one, or `version_info`), else None."""
    v = tuple(sys.version_info if version_info is None else version_info)
    if v[:2] >= MIN:
        return None
    return ("sglang-specprof needs Python %d.%d or newer and this is Python %s: make the venv with a newer one "
            "(python3.11 -m venv .venv, or python3.12, ...)" % (MIN + (".".join(str(x) for x in v[:3]),)))
