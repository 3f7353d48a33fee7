"""The advisor's last measured error, as bench/advisor_check.py published it with the package."""

from __future__ import annotations

import json
import math
import os

# the advisor's error as bench/advisor_check.py last measured it against an interleaved sweep
# (`advisor_check.py --publish` writes it), shipped with the package
ERROR_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "advisor_error.json")
_errors: dict = {}  # (path, mtime, size) -> what the file says: read once, not at every window


def _published(path: str) -> dict:
    """The file's figures by concurrency ({"by_concurrency": {...}, ...}), or {"unknown": why}."""
    try:
        st = os.stat(path)
        key = (path, st.st_mtime_ns, st.st_size)
        if key not in _errors:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            by = data.get("by_concurrency") if isinstance(data, dict) else None
            if not isinstance(by, dict) or not by or not all(
                    str(c).isdigit() and int(c) > 0 and isinstance(v, dict)
                    and all(isinstance(v.get(k), (int, float)) and not isinstance(v.get(k), bool)
                            for k in ("max_abs_error", "median_abs_error")) for c, v in by.items()):
                raise ValueError("no error by concurrency in it")
            _errors.clear()
            _errors[key] = data
        return _errors[key]
    except FileNotFoundError:
        return {"unknown": f"{os.path.basename(path)} is not in the package"}
    except (OSError, ValueError, AttributeError, RecursionError) as e:  # JSONDecodeError is a ValueError
        return {"unknown": f"{os.path.basename(path)} cannot be read ({type(e).__name__})"}


def last_error(batch: float, path: str | None = None) -> dict:
    """The advisor's last measured error at the load nearest `batch` requests a cycle (by
    ratio): the largest and the median |error| of its predictions relative to the profiled
    setting, the sweep's release, date and results; or {"unknown": why}."""
    data = _published(path or ERROR_FILE)
    if "unknown" in data:
        return data
    by = data["by_concurrency"]
    c = min(by, key=lambda c: abs(math.log(max(batch, 1e-9) / int(c))))
    e = by[c]
    return {"concurrency": int(c), "max_abs_error": e["max_abs_error"], "median_abs_error": e["median_abs_error"],
            "predictions": e.get("predictions"), "rounds": e.get("rounds"), "release": data.get("release"),
            # the sweeps that measured this load (a file of several sweeps says so for each load)
            "date": e.get("date", data.get("date")), "results": e.get("results", data.get("results")),
            "of": "each prediction's tokens/s relative to the profiled setting's, against the sweep's medians"}


def with_error(adv: dict) -> dict:
    """`adv` with the advisor's last measured error at its batch (`last_error`)."""
    adv["last_measured_error"] = last_error(adv.get("batch") or 1.0)
    return adv

