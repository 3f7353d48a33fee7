"""The trees a topk > 1 profile can speak for: the profiled tree pruned, each with a range. Plain Python."""

from __future__ import annotations

from .model import Growth, Inputs, cycle_ms


def tree_capacity(topk: int, steps: int) -> int:
    """The draft nodes a tree of `steps` at `topk` chooses its draft tokens from (SGLang takes
    the best-scored num-draft-tokens - 1 of topk + (steps - 1) * topk^2 candidates)."""
    return topk + (steps - 1) * topk * topk


def _ladder(n: int) -> list[int]:
    """`n` and the draft-token counts below it worth listing: 2, 3, 4, 6, 8, 12, 16, ..."""
    out, v = {n}, 2
    while v < n:
        out.update(x for x in (v, v * 3 // 2) if x < n)
        v *= 2
    return sorted(out, reverse=True)


def tree_bounds(a: list[float], topk: int, steps: int, tokens: int, profiled_tokens: int) -> tuple:
    """(low, measured, high) of E, the tokens a request commits a cycle, in the tree of `steps` at `topk`
    verifying `tokens`, from a profiled tree of len(a) steps (`profiled_tokens` a request) whose
    acceptance by level is `a`.

    E - 1 is the sum over the tree's draft nodes of each one's chance of being accepted; a node
    cut leaves its ancestors' chances as they were; and both trees take the best-scored of the
    same candidates down to `steps`, so this tree holds the top m' of the nodes the profiled one
    had down to that depth (m of them, unknown: the deeper levels took some of its tokens), and,
    where it has more tokens than m, candidates the profile never verified, scored below all
    it did. Taking the draft's scores to order the nodes by their chance of acceptance (what
    the tree is chosen by): low, the nodes kept hold at least their share of what the profiled
    nodes down to `steps` accepted; measured, the profiled levels down to this tree's depth;
    high, that and each node never verified at most the profiled tree's mean."""
    S, N = len(a), profiled_tokens
    run, e_s, e_depth, e_all = 1.0, 1.0, 1.0, 1.0
    for d in range(S):
        run *= a[d]
        e_all += run
        if d < steps:
            e_s += run
            if d < tokens - 1:
                e_depth += run
    most = min(N - 1, tree_capacity(topk, steps))  # profiled nodes down to `steps`, at most
    # and at least: a node below `steps` brings its ancestors down to it; the levels below
    # `steps` hold at most their candidates
    least = max(min(steps, N - 1), N - 1 - (tree_capacity(topk, S) - tree_capacity(topk, steps)))
    low = 1.0 + (e_s - 1.0) * min(1.0, (tokens - 1) / most) if most > 0 else 1.0
    unverified = max(tokens - 1 - least, 0)
    high = min(e_depth + unverified * (e_all - 1.0) / max(N - 1, 1), 1.0 + min(steps, tokens - 1))
    return min(low, e_depth), e_depth, high


def tree_rows(inp: Inputs, g: Growth, scale: float) -> dict:
    """The trees at the profiled topk that the profile can speak for: the profiled tree pruned
    (fewer draft tokens, fewer steps), each with tokens/s and a range (`tree_bounds` for its
    acceptance, central halfway between its low and measured figures; the verify growth's
    bounds for its cycle); and a sentence for each kind of setting it cannot predict."""
    T, S, N = inp.topk, inp.steps, inp.verified()
    a = [x if x is not None else 0.0 for x in inp.per_position[:S]]
    rows = []
    for s in range(S, 0, -1):
        for n in _ladder(min(N, tree_capacity(T, s) + 1)):
            profiled = s == S and n == N
            if n < 2 or (n - 1 < s and not profiled):
                continue  # a step whose level the tree has no token for: the same tree at fewer steps costs less
            lo, seen, hi = tree_bounds(a, T, s, n, N)
            central_t = cycle_ms(inp, s, g.per_token, n) * scale
            ends = (cycle_ms(inp, s, g.low, n) * scale, cycle_ms(inp, s, g.high, n) * scale)
            t_lo, t_hi = min(ends), max(ends)
            if not (central_t > 0 and t_lo > 0):
                continue
            tok = lambda e, t: inp.batch * e / (t / 1000.0)  # noqa: E731
            e_c = (lo + seen) / 2  # nodes never verified, scored below all that were, add nothing but to `high`
            rows.append({"topk": T, "steps": s, "draft_tokens": n, "expected_tokens": round(e_c, 4),
                         "expected_range": [round(lo, 4), round(hi, 4)], "cycle_ms": round(central_t, 4),
                         "tokens_per_s": round(tok(e_c, central_t), 2), "low": round(tok(lo, t_hi), 2),
                         "high": round(tok(hi, t_lo), 2), "profiled": profiled})
    cannot = []
    if N - 1 < tree_capacity(T, S):
        cannot.append(f"more than {N} draft tokens at topk {T}: the nodes a larger tree adds were never verified, "
                      f"so their acceptance is unknown; profile with --speculative-num-draft-tokens "
                      f"{min(2 * N, tree_capacity(T, S) + 1)} to measure them")
    cannot.append(f"more than {S} steps at topk {T}: the levels past {S} were never drafted; profile with "
                  f"--speculative-num-steps {S + 1} (and draft tokens to fill them) to measure them")
    cannot.append(f"topk {T + 1} or more: the candidates past the first {T} of each node were never drafted; "
                  f"profile with --speculative-eagle-topk {T + 1} or more to measure them")
    if T > 2:
        cannot.append(f"topk 2 to {T - 1}: a narrower tree keeps branches that neither a chain nor this tree pruned "
                      f"holds, and the profile records how deep each accepted path reached, not through which "
                      f"branch; profile at that topk to measure it")
    return {"topk": T, "steps": S, "draft_tokens": N, "rows": rows, "not_predicted": cannot}
