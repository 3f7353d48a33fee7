"""The 0-step verify routed through the decode attention kernel (zero_step.py), on fakes.

Whether the decode kernel gives the tokens a server without speculation gives is a GPU check
(bench/zero_step.py --compare, docs/benchmarks.md); here: which backends are converted, and
that a converted one builds decode metadata over one more position a request, in both its
eager and its CUDA-graph paths, and computes a verify's attention with forward_decode."""
from __future__ import annotations

import ast
import dataclasses
import sys
import types
import zipfile

import pytest

import fakes  # noqa: F401  (puts overlay/ on the path)
from conftest import pinned_wheel
from specprof_build import release
from sglang.specprof import zero_step


class Lens(list):
    """A 1-d tensor's slicing and `+ 1`, enough for the backend's length arithmetic."""

    def __getitem__(self, i):
        got = super().__getitem__(i)
        return Lens(got) if isinstance(i, slice) else got

    def __add__(self, n):
        return Lens(x + n for x in self)


def fake_torch():
    t = types.ModuleType("torch")
    t.int64, t.int32, t.float32 = "int64", "int32", "float32"
    t.empty = lambda shape, dtype=None, device=None: ("empty", shape if isinstance(shape, tuple) else (shape,), dtype)
    return t


class Mode:
    def __init__(self, name):
        self.name = name

    def is_target_verify(self):
        return self.name == "TARGET_VERIFY"


@dataclasses.dataclass
class Metadata:
    attn_logits: object
    attn_lse: object
    max_extend_len: object
    num_kv_splits: object
    kv_indptr: object
    kv_indices: object
    qo_indptr: object
    custom_mask: object
    mask_indptr: object
    window_kv_indptr: object
    window_kv_indices: object
    window_num_kv_splits: object
    window_kv_offsets: object
    swa_attn_logits: object = None


def backend_module():
    """A module holding a TritonAttnBackend with 0.5.16's helper signatures that records its calls."""
    mod = types.ModuleType("fake_triton_backend")
    mod.ForwardMetadata = Metadata
    mod.ForwardMode = types.SimpleNamespace(DECODE=Mode("DECODE"))

    class TritonAttnBackend:
        def __init__(self, num_draft_tokens=1, **attrs):
            self.num_draft_tokens, self.calls = num_draft_tokens, []
            self.device, self.max_context_len, self.num_head, self.max_kv_splits, self.v_head_dim = "cpu", 100, 4, 8, 16
            self.window_kv_indptr, self.cuda_graph_kv_indices, self.cuda_graph_num_kv_splits = "w", "graph-kv", Lens(
                range(64))
            self.dcp_size, self.sliding_window_size, self.swa_v_head_dim = 1, None, None
            self.enable_deterministic = self.use_mla = self.use_verify_splitkv = self.use_sliding_window_kv_pool = False
            self._translate_kv_loc = None
            self.__dict__.update(attrs)

        def _apply_cuda_graph_metadata(self, bs, req_pool_indices, seq_lens, forward_mode, spec_info):
            self.calls.append(("apply", forward_mode.name))

        def _fill_kv_indptr_and_indices(self, bs, seq_lens, req_pool_indices, kv_indices):
            self.calls.append(("fill", bs, list(seq_lens), kv_indices))
            return ("indptr", bs)

        def _build_cuda_graph_forward_metadata(self, bs, forward_mode, spec_info, swa_out_cache_loc=None):
            self.calls.append(("build", bs, forward_mode.name))
            return forward_mode.name

        def get_num_kv_splits(self, num_kv_splits, seq_lens):
            self.calls.append(("splits", list(seq_lens)))

        def init_forward_metadata(self, forward_batch):
            self.calls.append(("init", forward_batch.forward_mode.name))

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
            return ("extend", q, save_kv_cache, kw)

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
            return ("decode", q, save_kv_cache, kw)

    TritonAttnBackend.__module__ = mod.__name__
    mod.TritonAttnBackend = TritonAttnBackend
    return mod


@pytest.fixture
def mod(monkeypatch):
    m = backend_module()
    monkeypatch.setitem(sys.modules, m.__name__, m)
    monkeypatch.setitem(sys.modules, "torch", fake_torch())
    monkeypatch.delenv(zero_step.ENV, raising=False)
    return m


def batch(mode, seq_lens, seq_lens_sum=None):
    return types.SimpleNamespace(forward_mode=Mode(mode), seq_lens=Lens(seq_lens),
                                 req_pool_indices=Lens(range(len(seq_lens))), seq_lens_sum=seq_lens_sum)


def test_a_one_token_verify_is_computed_by_the_decode_kernel(mod):
    b = mod.TritonAttnBackend()
    assert zero_step.decode_route(b)
    verify, prefill = batch("TARGET_VERIFY", [5, 9]), batch("EXTEND", [5, 9])
    assert b.forward_extend("q", "k", "v", None, verify, sinks=None) == ("decode", "q", True, {"sinks": None})
    assert b.forward_extend("q", "k", "v", None, prefill, save_kv_cache=False) == ("extend", "q", False, {})
    # KV shared from another layer (k and v None) is not a decode's input: upstream's path
    assert b.forward_extend("q", None, None, None, verify)[0] == "extend"


def test_eager_metadata_is_a_decodes_over_the_prefix_and_the_token(mod):
    b = mod.TritonAttnBackend()
    zero_step.decode_route(b)
    b.init_forward_metadata(batch("TARGET_VERIFY", [5, 9, 1], seq_lens_sum=15))
    fill = [c for c in b.calls if c[0] == "fill"]
    assert fill == [("fill", 3, [6, 10, 2], ("empty", (18,), "int64"))]
    assert ("splits", [6, 10, 2]) in b.calls
    m = b.forward_metadata
    assert m.attn_logits == ("empty", (3, 4, 8, 16), "float32") and m.attn_lse == ("empty", (3, 4, 8), "float32")
    assert m.qo_indptr is m.custom_mask is m.mask_indptr is m.max_extend_len is None
    assert m.kv_indptr == ("indptr", 3)
    # without the host's sum the indices are sized for the longest context, as upstream's are
    b.init_forward_metadata(batch("TARGET_VERIFY", [5, 9]))
    assert [c for c in b.calls if c[0] == "fill"][-1][3] == ("empty", (200,), "int64")
    b.init_forward_metadata(batch("DECODE", [5]))
    assert b.calls[-1] == ("init", "DECODE")


def test_graph_metadata_fills_the_decode_buffers_and_builds_a_decode_view(mod):
    b = mod.TritonAttnBackend()
    zero_step.decode_route(b)
    b._apply_cuda_graph_metadata(4, Lens(range(4)), Lens([3, 7, 1, 1]), Mode("TARGET_VERIFY"), None)
    assert b.calls == [("fill", 4, [4, 8, 2, 2], "graph-kv"), ("splits", [4, 8, 2, 2])]
    assert b._build_cuda_graph_forward_metadata(4, Mode("TARGET_VERIFY"), None) == "DECODE"
    b.calls.clear()
    b._apply_cuda_graph_metadata(4, Lens(range(4)), Lens([3, 7, 1, 1]), Mode("DRAFT_EXTEND_V2"), None)
    assert b.calls == [("apply", "DRAFT_EXTEND_V2")]
    assert b._build_cuda_graph_forward_metadata(4, Mode("DRAFT_EXTEND_V2"), None) == "DRAFT_EXTEND_V2"


@pytest.mark.parametrize("attrs, why", [
    ({"num_draft_tokens": 4}, "more than one token"),
    ({"sliding_window_size": 4096}, "sliding_window_size is 4096"),
    ({"dcp_size": 2}, "dcp_size is 2"),
    ({"use_mla": True}, "use_mla is True"),
    ({"enable_deterministic": True}, "enable_deterministic is True"),
    ({"_translate_kv_loc": print}, "translate_kv_loc"),
])
def test_a_backend_where_decode_is_not_the_same_computation_is_left_alone(mod, attrs, why):
    b = mod.TritonAttnBackend(**attrs)
    assert why in zero_step.unsuitable(b)
    assert not zero_step.decode_route(b)
    assert type(b) is mod.TritonAttnBackend


def test_a_release_whose_helpers_differ_is_left_alone(mod):
    def apply(self, plan, bs, req_pool_indices, seq_lens, forward_mode, spec_info):
        pass

    newer = type("TritonAttnBackend", (mod.TritonAttnBackend,), {"_apply_cuda_graph_metadata": apply})
    assert "takes (plan, bs" in zero_step.unsuitable(newer())
    other = type("FlashAttentionBackend", (mod.TritonAttnBackend,), {})
    assert "FlashAttentionBackend, not triton" in zero_step.unsuitable(other())


def worker_with(factory):
    return types.SimpleNamespace(_target_worker=types.SimpleNamespace(
        model_runner=types.SimpleNamespace(_get_attention_backend=factory)))


def test_install_converts_the_backends_built_for_one_draft_token(mod):
    made = iter([mod.TritonAttnBackend(num_draft_tokens=1), mod.TritonAttnBackend(num_draft_tokens=4)])
    w = worker_with(lambda init_new_workspace=False: next(made))
    assert zero_step.install(w)
    one = w._target_worker.model_runner._get_attention_backend(init_new_workspace=True)
    four = w._target_worker.model_runner._get_attention_backend(init_new_workspace=True)
    assert type(one).__name__ == "ZeroStepDecodeTritonAttnBackend" and isinstance(one, mod.TritonAttnBackend)
    assert type(four) is mod.TritonAttnBackend
    assert not zero_step.decode_route(one)   # converted once only


def test_the_environment_variable_keeps_upstreams_path(mod, monkeypatch):
    monkeypatch.setenv(zero_step.ENV, "0")
    factory = lambda: mod.TritonAttnBackend()  # noqa: E731
    w = worker_with(factory)
    assert not zero_step.install(w)
    assert w._target_worker.model_runner._get_attention_backend is factory
    assert not zero_step.install(types.SimpleNamespace())


def signatures(source: str) -> dict:
    """Each method of TritonAttnBackend in `source`: its parameter names after self."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == "TritonAttnBackend":
            return {f.name: tuple(a.arg for a in f.args.args[1:]) for f in node.body
                    if isinstance(f, ast.FunctionDef)}
    return {}


def test_the_default_releases_backend_has_the_helpers_with_the_parameters_passed():
    """A rebase onto a release that renames a helper's parameters must not convert its backend
    blind: `helpers_missing` compares names, and they are 0.5.16's."""
    version = release.default_release()
    with zipfile.ZipFile(pinned_wheel(version)) as z:
        got = signatures(z.read("sglang/srt/layers/attention/triton_backend.py").decode())
    for name, params in zero_step._HELPERS.items():
        assert got[name][:len(params)] == params, (version, name, got.get(name))
    for name in ("init_forward_metadata", "forward_extend", "forward_decode"):
        assert got[name][:5] in (("forward_batch",), ("q", "k", "v", "layer", "forward_batch")), name
