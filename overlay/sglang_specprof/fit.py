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


BOUNDED_AT_ONE_STEP_COUNT = "bounded above by batch sizes at one step count"
CONTEXT_SPREAD = 1.5  # verify's slope with context at two batch sizes this far apart (and beyond noise): not one plane
# the requests a cycle of one load's points (10th to 90th percentile, by cycles) within this ratio: the
# plane cannot tell a verified token's cost from a request's
NARROW_REQUESTS = 1.5


def bounded_growth_note(how: str) -> str:
    """What measures verify's growth where a profile only bounds it (`how`, a Growth's, starting
    BOUNDED_AT_ONE_STEP_COUNT): a second step count at the same load tells a verified token's cost
    from a request's; kernel samples at two token counts or more read it off the kernels."""
    second = ("a stretch at a second step count at this load (--speculative-num-steps, or --speculative-adaptive "
              "with --speculative-adaptive-policy cost, which tries step counts) or ")
    return ("verify's growth with the tokens is bounded here, not measured: " + (second if "one load" in how else "")
            + "kernel samples at two batch sizes or more (--speculative-profile-kernels N) measure it")


def context_slopes_agree(pts: list) -> bool:
    """Whether verify time rises with the context tokens at one slope at every batch size (each
    batch-size bucket's own weighted line through verify time against context, three points
    at least): what the plane through tokens and context assumes. False where two buckets'
    slopes differ by more than CONTEXT_SPREAD times and three standard errors."""
    from .window import bucket_of

    groups: dict = {}
    for t, ctx, v, c, reqs, _k in pts:
        groups.setdefault(bucket_of(max(1, round(reqs))), []).append((ctx, v, c))
    slopes = []
    for g in groups.values():
        if len(g) < 3 or len({round(x, 1) for x, _, _ in g}) < 3:
            continue
        f = wls([[1.0, x] for x, _, _ in g], [v for _, v, _ in g], [c for _, _, c in g])
        if f is not None and math.isfinite(f[1][1]) and f[0][1] > 0:
            slopes.append((f[0][1], f[1][1]))
    for a, sa in slopes:
        for b, sb in slopes:
            if a > b * CONTEXT_SPREAD and a - b > 3 * math.hypot(sa, sb):
                return False
    return True


def requests_spread(pts: list) -> tuple:
    """The 10th and 90th percentile of the requests a cycle over `fit_verify`'s points, by cycles."""
    ranked = sorted((r, c) for _, _, _, c, r, _ in pts)
    total = sum(c for _, c in ranked)
    out = []
    for q in (0.1, 0.9):
        run = 0.0
        for r, c in ranked:
            run += c
            if run >= q * total:
                out.append(r)
                break
    return out[0], out[1]


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
        if found is not None and len({round(t / r, 3) for t, _, _, _, r, _ in pts}) == 1 \
                and not context_slopes_agree(pts):
            # one number of tokens a request throughout: the tokens rise with the requests, and
            # the plane's context term, one slope for every batch size, does not hold (attention
            # over a context runs wider with more requests): what each request costs on its own
            # is counted as its tokens'. An upper bound; halfway taken.
            found = Growth(found.per_token / 2, 0.0, found.high,
                           BOUNDED_AT_ONE_STEP_COUNT + " (a request's own cost counted as its tokens'), halfway taken")
        elif found is not None and len({round(t / r, 3) for t, _, _, _, r, _ in pts}) == 1:
            lo, hi = requests_spread(pts)
            if hi < NARROW_REQUESTS * lo:
                # one load: its requests a cycle barely vary, and the plane's split between a token's
                # cost and a request's swings with noise (one server's 41-48 requests gave 0.022 ms a
                # token at 3 steps and 0.002 at 6, where its step counts measured 0.008 and 0.018): the
                # plane's figure kept, its range from flat to proportional (advisor.inputs_from_bucket)
                found = Growth(found.per_token, 0.0, math.inf,
                               f"{BOUNDED_AT_ONE_STEP_COUNT} (one load, {lo:.0f}-{hi:.0f} requests a cycle: a "
                               f"token's cost not told from a request's), the plane's figure taken")
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


CURVE_MERGE = 0.05  # clusters of verified tokens within 5% of each other are one point of the curve


class TokenCurve:
    """The kernel time of verify that follows the verified tokens (GEMMs, sampling, copies: not
    attention, which follows the requests and their context), against the verified tokens of
    a cycle, from the kernel samples (`merge.kernel_points`): one point per batch-size bucket
    and step count sampled, the points joined by straight lines.

    A GEMM's time is flat in the tokens while its weights' reading bounds it and grows in
    proportion once its arithmetic does: convex and non-decreasing, at most in proportion. So
    between two measured points the chord bounds it from above and the neighbouring chords'
    extensions from below; below the fewest tokens sampled it lies between the first chord
    extended and the first point's level; beyond the most tokens sampled between the last
    chord extended and the last point scaled in proportion (the central figure halfway)."""

    def __init__(self, points: list[tuple[float, float]], how: str):
        self.points, self.how = points, how

    @classmethod
    def fit(cls, kpoints: list, steps: int, draft_tokens: int | None = None) -> "TokenCurve | None":
        from .window import bucket_of

        groups: dict = {}
        for p in kpoints or []:
            try:
                reqs, token_ms, _att, cycles, at = p[0], p[1], p[2], p[3], p[4] if len(p) > 4 else None
            except (TypeError, IndexError):
                continue
            if not (isinstance(reqs, (int, float)) and reqs > 0 and isinstance(token_ms, (int, float))
                    and token_ms >= 0 and isinstance(cycles, int) and cycles > 0):
                continue
            per_req = (at + 1) if at is not None else (draft_tokens or steps + 1)
            g = groups.setdefault((bucket_of(max(1, round(reqs))), per_req), [0.0, 0.0, 0])
            g[0] += reqs * per_req * cycles
            g[1] += token_ms * cycles
            g[2] += cycles
        pts = sorted((m / c, t / c, c) for m, t, c in groups.values())
        merged: list = []
        for m, t, c in pts:
            if merged and m <= merged[-1][0] * (1 + CURVE_MERGE):
                pm, pt, pc = merged[-1]
                merged[-1] = ((pm * pc + m * c) / (pc + c), (pt * pc + t * c) / (pc + c), pc + c)
            else:
                merged.append((m, t, c))
        if len(merged) < 2:
            return None
        # non-decreasing: a point below the one before it (noise) is taken at its level
        out = []
        for m, t, _ in merged:
            out.append((m, max(t, out[-1][1]) if out else t))
        cycles = sum(c for _, _, c in merged)
        return cls(out, f"measured from the kernel view ({cycles} sampled cycles at {len(out)} token counts, "
                        f"{out[0][0]:.0f}-{out[-1][0]:.0f} tokens a cycle; attention taken to follow the requests)")

    def _slope(self, i: int) -> float:
        (m0, t0), (m1, t1) = self.points[i], self.points[i + 1]
        return (t1 - t0) / (m1 - m0)

    def at(self, m: float) -> tuple[float, float, float]:
        """(central, low, high) kernel ms of a cycle verifying `m` tokens."""
        p = self.points
        n = len(p)
        if m <= p[0][0]:
            ext = p[0][1] + self._slope(0) * (m - p[0][0])
            return max(ext, 0.0), max(ext, 0.0), p[0][1]
        if m >= p[-1][0]:
            ext = p[-1][1] + self._slope(n - 2) * (m - p[-1][0])
            prop = p[-1][1] * m / p[-1][0]
            hi = max(prop, ext)
            return (ext + hi) / 2, ext, hi
        i = max(j for j in range(n - 1) if p[j][0] <= m)
        chord = p[i][1] + self._slope(i) * (m - p[i][0])
        lows = [p[i][1]]
        if i > 0:
            lows.append(p[i][1] + self._slope(i - 1) * (m - p[i][0]))
        if i + 2 < n:
            lows.append(p[i + 1][1] + self._slope(i + 1) * (m - p[i + 1][0]))
        return chord, min(max(lows), chord), chord

    def delta(self, m_from: float, m_to: float) -> tuple[float, float, float]:
        """What verify's kernel time changes by from `m_from` tokens a cycle to `m_to`:
        (central, lowest, highest)."""
        base = self.at(m_from)[0]
        c, lo, hi = self.at(m_to)
        return c - base, lo - base, hi - base
