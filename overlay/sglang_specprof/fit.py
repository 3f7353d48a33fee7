"""What one more verified token adds to verify, fitted from a profile's buckets. Plain Python."""

from __future__ import annotations

import math

from .model import VERIFY, Growth

LOCAL_MIN_CYCLES = 20  # cycles a bucket needs to be a point of the growth at its own batch sizes


def solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-12 * max(1.0, max(abs(x) for row in m for x in row[:n])):
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


def wls(xs: list[list[float]], ys: list[float], ws: list[float]):
    """Weighted least squares: coefficients and their standard errors, or None."""
    p = len(xs[0])
    xtx = [[sum(w * x[i] * x[j] for x, w in zip(xs, ws)) for j in range(p)] for i in range(p)]
    xty = [sum(w * x[i] * y for x, y, w in zip(xs, ys, ws)) for i in range(p)]
    beta = solve(xtx, xty)
    if beta is None:
        return None
    n = len(ys)
    if n <= p:
        return beta, [float("inf")] * p
    # a point is the mean of w cycles: variance sigma^2 / w, sigma^2 from the residuals
    sigma2 = sum(w * (y - sum(b * xi for b, xi in zip(beta, x))) ** 2 for x, y, w in zip(xs, ys, ws)) / (n - p)
    se = []
    for i in range(p):
        col = solve(xtx, [1.0 if j == i else 0.0 for j in range(p)])
        se.append(math.sqrt(max(col[i] * sigma2, 0.0)) if col else float("inf"))
    return beta, se


def fit_verify(points: list, steps: int, draft_tokens: int | None = None) -> Growth | None:
    """What a verified token adds to verify, from [requests per cycle, context tokens, verify ms,
    cycles(, step count)] points (one per window and bucket, `merge.verify_points`; a point
    without its own step count was run at `steps`, verifying `draft_tokens` a request, or
    steps + 1)."""
    own = [len(p) > 4 and p[4] is not None for p in points]  # run at a step count of its own (adaptive)
    at = [p[4] if o else steps for p, o in zip(points, own)]
    per_req = [draft_tokens if draft_tokens and not o else k + 1 for k, o in zip(at, own)]
    pts = [(p[0] * d, p[1], p[2], p[3], p[0], k) for p, k, d in zip(points, at, per_req) if p[3] and p[0]]
    if len({round(t, 3) for t, *_ in pts}) < 2:
        return None  # one batch size: verify's growth with tokens is not seen
    ws = [c for _, _, _, c, _, _ in pts]
    ys = [v for _, _, v, _, _, _ in pts]

    def growth(xs, ys, ws, col, how):
        fit = wls(xs, ys, ws)
        if fit is None or not math.isfinite(fit[1][col]):
            return None
        g, se = fit[0][col], fit[1][col]
        return Growth(max(g, 0.0), max(g - 2 * se, 0.0), max(g + 2 * se, 0.0), how)

    found = None
    if all(ctx is not None for _, ctx, *_ in pts) and len(pts) >= 4:
        found = growth([[1.0, t, ctx] for t, ctx, *_ in pts], ys, ws, 1, "measured")
    if found is None:
        # Several step counts at one number of requests (an adaptive profile, or profiles
        # merged): there the verified tokens differ and the requests (whose attention over
        # their context the tokens' cost would be mistaken for) do not. Verify time against
        # verified tokens, with a level of its own for each number of requests, so that only
        # the step counts' differences at one number of requests measure a token's cost.
        groups: dict[int, list] = {}
        for p in pts:
            groups.setdefault(round(p[4]), []).append(p)
        mixed = [g for g in groups.values() if len({p[5] for p in g}) >= 2]
        used = [p for g in mixed for p in g]
        if mixed and len(used) >= len(mixed) + 2:
            xs = [[1.0 if i == j else 0.0 for j in range(len(mixed))] + [p[0]]
                  for i, g in enumerate(mixed) for p in g]
            found = growth(xs, [p[2] for p in used], [p[3] for p in used], len(mixed),
                           "measured across step counts (no context lengths in the profile)")
    if found is not None:
        return found
    fit = wls([[1.0, t] for t, *_ in pts], ys, ws)
    if fit is None:
        return None
    slope = max(fit[0][1], 0.0)
    return Growth(0.0, 0.0, slope, "bounded above by batch sizes (no context lengths in the profile)")


def local_growth(runs: dict):
    """In an adaptive profile, verify's growth per verified token at one bucket's batch sizes
    alone (`runs`: {step count: (key, bucket)} of those batch sizes): the weighted slope of
    verify time against verified tokens a cycle among the step counts they ran at (three at
    least). Attention over each request's context makes the growth differ with the batch size
    (on the H200, 0.006 ms a token at 17-32 requests, 0.015 at 65-128), which one plane through
    every bucket averages away. None where there are too few."""
    pts = []
    for s, (_, b) in runs.items():
        v = (b["phases"].get(VERIFY) or {}).get("gpu_ms", {}).get("mean")
        n = b["accept"].get("verified_requests")
        if v is None or not n or b["cycles"] < LOCAL_MIN_CYCLES:
            continue
        pts.append((n / b["cycles"] * (s + 1), v, b["cycles"]))
    if len({round(t, 3) for t, _, _ in pts}) < 3:
        return None
    fit = wls([[1.0, t] for t, _, _ in pts], [v for _, v, _ in pts], [c for _, _, c in pts])
    if fit is None or not math.isfinite(fit[1][1]):
        return None
    g, se = fit[0][1], fit[1][1]
    return Growth(max(g, 0.0), max(g - 2 * se, 0.0), max(g + 2 * se, 0.0),
                  "measured across step counts at these batch sizes")
