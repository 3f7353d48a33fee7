"""Step 0 of adaptive speculation, run as a plain decode.

With `--speculative-adaptive`, a batch at 0 steps drafts nothing: upstream still runs the
target through its TARGET_VERIFY graph, with one token a request. With the triton attention
backend that path computes attention with the extend kernel, one query row in a tile made
for many, each query head reading the whole prefix on its own; a server without speculation
runs the split-KV decode kernel instead. On an 8B-shaped model at 65-128 running requests the
verify's attention took 17.3 ms a cycle where a whole plain decode cycle took 6.3 (see
docs/benchmarks.md, "The zero-step tax").

Here the target backend of the 0-step state computes that one token's attention with the
decode kernel, over the prefix and the token itself, exactly as a decode forward does: the
token's KV slot is already in the request's row of `req_to_token` (the verify assigned it),
so the decode metadata is the verify's with one more position a request. Everything else
(forward mode, logits of every verified token, hidden states for the draft extend) is
upstream's. Set SGLANG_SPECPROF_ZERO_STEP_DECODE=0 to keep upstream's path.

It applies where the decode kernel computes the same thing: the triton backend at one draft
token, no sliding window, no decode context parallelism, no MLA, no deterministic mode, no
unified pool translation; on releases whose backend has the 0.5.16 buffer helpers. Elsewhere
the backend is left as it is, and `install` says why.
"""
from __future__ import annotations

import inspect
import logging
import os
import sys

logger = logging.getLogger(__name__)

ENV = "SGLANG_SPECPROF_ZERO_STEP_DECODE"

# The backend's helpers this module calls, with the parameters it passes (0.5.13 to 0.5.22).
_HELPERS = {
    "_apply_cuda_graph_metadata": ("bs", "req_pool_indices", "seq_lens", "forward_mode", "spec_info"),
    "_fill_kv_indptr_and_indices": ("bs", "seq_lens", "req_pool_indices", "kv_indices"),
    "_build_cuda_graph_forward_metadata": ("bs", "forward_mode", "spec_info"),
    "get_num_kv_splits": ("num_kv_splits", "seq_lens"),
}
_subclasses: dict = {}


def wanted() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def helpers_missing(cls) -> str | None:
    """Why `cls` lacks what the decode route calls, or None."""
    for name, params in _HELPERS.items():
        fn = getattr(cls, name, None)
        if fn is None:
            return f"its backend has no {name}"
        try:
            got = tuple(p for p in inspect.signature(fn).parameters if p != "self")
        except (TypeError, ValueError):
            return f"{name} has no signature to check"
        if got[:len(params)] != params:
            return f"{name} takes ({', '.join(got)})"
    return None


def unsuitable(backend) -> str | None:
    """Why this backend's verify at one token is not a plain decode, or None."""
    if type(backend).__name__ != "TritonAttnBackend":
        return f"the attention backend is {type(backend).__name__}, not triton"
    if getattr(backend, "num_draft_tokens", None) != 1:
        return "it verifies more than one token a request"
    g = backend.__dict__.get
    for attr, bad in (("dcp_size", lambda v: v not in (None, 1)), ("enable_deterministic", bool),
                      ("use_mla", bool), ("use_verify_splitkv", bool), ("use_sliding_window_kv_pool", bool),
                      ("sliding_window_size", lambda v: v is not None and v > 0),
                      ("swa_v_head_dim", lambda v: v is not None), ("_translate_kv_loc", lambda v: v is not None)):
        if bad(g(attr)):
            return f"its {attr.lstrip('_')} is {g(attr)!r}"
    return helpers_missing(type(backend))


def decode_route(backend) -> bool:
    """Make a 0-step target backend run its verify as a decode (in place); True when it did."""
    why = unsuitable(backend)
    if why:
        logger.info("step-0 verify keeps upstream's path: %s", why)
        return False
    backend.__class__ = _subclass(type(backend))
    return True


def install(worker) -> bool:
    """Route the attention of every 0-step state the worker builds through the decode kernel.

    Called once the adaptive controller exists and before its states are built (their graphs
    are captured as each is built): the target model runner's backend factory is wrapped on
    the instance, so a backend made for one draft token is converted before its graphs exist."""
    if not wanted():
        logger.info("step-0 verify keeps upstream's path (%s=0)", ENV)
        return False
    runner = getattr(getattr(worker, "_target_worker", None), "model_runner", None)
    make = getattr(runner, "_get_attention_backend", None)
    if make is None:
        logger.info("step-0 verify keeps upstream's path: this release builds no backend per step count")
        return False

    def get_attention_backend(*args, **kwargs):
        backend = make(*args, **kwargs)
        if getattr(backend, "num_draft_tokens", None) == 1 and decode_route(backend):
            logger.info("step-0 verify runs the decode attention kernel (%s=0 keeps upstream's path)", ENV)
        return backend

    runner._get_attention_backend = get_attention_backend
    return True


def _subclass(base):
    if base in _subclasses:
        return _subclasses[base]
    module = sys.modules[base.__module__]
    Metadata, Mode = module.ForwardMetadata, module.ForwardMode
    import torch

    class ZeroStepDecode(base):
        """`base` whose TARGET_VERIFY at one token a request is computed as a decode."""

        def init_forward_metadata(self, forward_batch):
            if not forward_batch.forward_mode.is_target_verify():
                return super().init_forward_metadata(forward_batch)
            bs = len(forward_batch.req_pool_indices)
            lens = forward_batch.seq_lens[:bs] + 1
            total = forward_batch.seq_lens_sum
            total = bs * self.max_context_len if total is None else total + bs
            kv_indices = torch.empty(total, dtype=torch.int64, device=self.device)
            kv_indptr = self._fill_kv_indptr_and_indices(bs, lens, forward_batch.req_pool_indices, kv_indices)
            num_kv_splits = torch.empty((bs,), dtype=torch.int32, device=self.device)
            self.get_num_kv_splits(num_kv_splits, lens)
            f32 = torch.float32
            self.forward_metadata = Metadata(
                attn_logits=torch.empty((bs, self.num_head, self.max_kv_splits, self.v_head_dim),
                                        dtype=f32, device=self.device),
                attn_lse=torch.empty((bs, self.num_head, self.max_kv_splits), dtype=f32, device=self.device),
                max_extend_len=None, num_kv_splits=num_kv_splits, kv_indptr=kv_indptr, kv_indices=kv_indices,
                qo_indptr=None, custom_mask=None, mask_indptr=None, window_kv_indptr=self.window_kv_indptr,
                window_kv_indices=None, window_num_kv_splits=None, window_kv_offsets=None)

        def _apply_cuda_graph_metadata(self, bs, req_pool_indices, seq_lens, forward_mode, spec_info, *a, **kw):
            if not forward_mode.is_target_verify():
                return super()._apply_cuda_graph_metadata(bs, req_pool_indices, seq_lens, forward_mode,
                                                          spec_info, *a, **kw)
            bs = len(req_pool_indices)
            lens = seq_lens[:bs] + 1
            self._fill_kv_indptr_and_indices(bs, lens, req_pool_indices[:bs], self.cuda_graph_kv_indices)
            self.get_num_kv_splits(self.cuda_graph_num_kv_splits[:bs], lens)

        def _build_cuda_graph_forward_metadata(self, bs, forward_mode, spec_info, *a, **kw):
            if forward_mode.is_target_verify():
                forward_mode = Mode.DECODE
            return super()._build_cuda_graph_forward_metadata(bs, forward_mode, spec_info, *a, **kw)

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
            if k is not None and forward_batch.forward_mode.is_target_verify():
                return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kw)
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kw)

    ZeroStepDecode.__name__ = ZeroStepDecode.__qualname__ = f"ZeroStepDecode{base.__name__}"
    _subclasses[base] = ZeroStepDecode
    return ZeroStepDecode
