"""A bucket's acceptance counts: the fold that counts most cycles by value (no request cut, the same
tokens beside each request's drafts) gives what counting request by request gives, whatever the
lists."""
from hypothesis import given, settings, strategies as st

from fakes import FakeBackend  # noqa: F401  (puts overlay/ on the path)
from sglang_specprof.bucket import Bucket


def by_request(cycles):
    """Each request counted one at a time: the histograms, the tokens, the cuts."""
    hist, dh = [], []
    out = {"committed": 0, "cut_reqs": 0, "cut_tokens": 0, "verified": 0, "skipped": 0}
    for correct, committed, skipped in cycles:
        out["skipped"] += skipped
        for i, c in enumerate(correct):
            c = int(c) if c > 0 else 0
            dh.extend([0] * max(0, c + 1 - len(dh)))
            dh[c] += 1
            n = c + 1 if committed is None else int(committed[i])
            if n < c + 1:
                out["cut_reqs"] += 1
                out["cut_tokens"] += c + 1 - n
            hist.extend([0] * max(0, n + 1 - len(hist)))
            hist[n] += 1
            out["committed"] += n
        out["verified"] += len(correct)
    return hist, dh, out


@st.composite
def cycle(draw):
    correct = draw(st.lists(st.integers(min_value=-1, max_value=9), max_size=64))
    how = draw(st.sampled_from(["none", "one", "two", "cut", "mixed"]))
    if how == "none":
        committed = None
    elif how in ("one", "two"):  # each request took its drafts and the bonus (UNO: two beside its drafts)
        committed = [max(c, 0) + (1 if how == "one" else 2) for c in correct]
    else:
        committed = [max(c, 0) + 1 - draw(st.integers(min_value=0, max_value=max(c, 0))) if how == "cut"
                     else max(c, 0) + draw(st.integers(min_value=1, max_value=3)) for c in correct]
    return correct, committed, draw(st.integers(min_value=0, max_value=4))


@settings(max_examples=300, deadline=None)
@given(cycles=st.lists(cycle(), max_size=6))
def test_counting_by_value_is_counting_by_request(cycles):
    b = Bucket()
    for correct, committed, skipped in cycles:
        b.add_accept(list(correct), None if committed is None else list(committed), skipped)
    hist, dh, out = by_request(cycles)
    assert b.accept_hist == hist and b.drafts_hist == dh
    assert (b.committed, b.cut_reqs, b.cut_tokens, b.verified_reqs, b.skipped_reqs) == (
        out["committed"], out["cut_reqs"], out["cut_tokens"], out["verified"], out["skipped"])
    assert b.accept_cycles == len(cycles)
