"""Config-only model folders for dummy-weight servers (shared by the benchmarks and the GPU check)."""
import json
import os

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    # Llama-3.2-1B's shape: a cycle of about 2-3 ms at one request, where the host's share is largest
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=32000),
}


def _llama(shape: dict, **fields) -> dict:
    """A Llama config of `shape` (SHAPES' fields), with `fields` over the common ones."""
    return {**shape, "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 2, "architectures": ["LlamaForCausalLM"], "model_type": "llama", **fields}


def _write(folder: str, config: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def write_models(root, shape="8b"):
    """A Llama target and a 1-layer EAGLE3 draft of the same width; returns their folders."""
    s = SHAPES[shape]
    n = s["num_hidden_layers"]
    target = _write(os.path.join(root, "target"), _llama(s))
    draft = _write(os.path.join(root, "draft"), _llama(
        s, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=s["vocab_size"],
        target_hidden_size=s["hidden_size"], eagle_config={"eagle_aux_hidden_state_layer_ids": [1, n // 2 - 1, n - 4]}))
    return target, draft


def write_standalone_draft(root, shape="1b", vocab_of="8b"):
    """A plain Llama model as a STANDALONE draft (Llama-3.2-1B's shape by default) with the
    target's vocabulary; returns its folder."""
    s = dict(SHAPES[shape], vocab_size=SHAPES[vocab_of]["vocab_size"])
    return _write(os.path.join(root, f"draft-{shape}"), _llama(s, tie_word_embeddings=True))


def write_mimo_v2(root, layers=4, mtp_layers=3):
    """A small dense MiMoV2 target (MiMoV2FlashForCausalLM: full attention, no MoE), whose MTP
    layers are the multi-layer EAGLE draft (the same folder as the draft model path: SGLang
    builds MiMoV2MTP from it, one draft model per step). Read as a Llama config by transformers
    (its extra fields kept), so no remote code. Serve with `--enable-multi-layer-eagle
    --disable-hybrid-swa-memory` and as many steps as `mtp_layers`; returns its folder."""
    s = dict(SHAPES["1b"], num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
             vocab_size=SHAPES["8b"]["vocab_size"])
    zeros = [0] * layers
    return _write(os.path.join(root, "mimo-v2"), _llama(
        s, architectures=["MiMoV2FlashForCausalLM"], head_dim=128, v_head_dim=128, swa_num_attention_heads=16,
        swa_num_key_value_heads=4, swa_head_dim=128, swa_v_head_dim=128, hybrid_layer_pattern=zeros,
        sliding_window_size=-1, add_full_attention_sink_bias=False, add_swa_attention_sink_bias=False,
        moe_layer_freq=zeros, attention_bias=False, layernorm_epsilon=1e-5, swa_rope_theta=10000.0,
        num_nextn_predict_layers=mtp_layers))


def write_dflash_draft(root, shape="8b", block=8, dspark=False):
    """A 1-layer DFLASH draft (DFlashDraftModel) for the Llama target of `shape`: the target's width,
    a block of `block` tokens, the mask token the vocabulary's last id, the target's hidden
    states taken at three layers as EAGLE3's are. Serve with `--speculative-algorithm DFLASH`
    and `--speculative-num-draft-tokens` equal to `block`. `dspark`: the same as DSPARK's draft
    (Qwen3DSparkModel, 0.5.16's name, with a rank-64 Markov head), whose block is `block` - 1
    tokens beside the bonus (`--speculative-num-draft-tokens` still `block`). Returns its folder."""
    s = SHAPES[shape]
    n = s["num_hidden_layers"]
    extra = dict(architectures=["Qwen3DSparkModel"], markov_rank=64, markov_head_type="vanilla") if dspark else dict(
        architectures=["DFlashDraftModel"])
    return _write(os.path.join(root, "dspark-draft" if dspark else "dflash-draft"), _llama(
        dict(s, num_hidden_layers=1), head_dim=s["hidden_size"] // s["num_attention_heads"],
        dflash_config={"block_size": block - 1 if dspark else block, "mask_token_id": s["vocab_size"] - 1,
                       "num_target_layers": n, "target_layer_ids": [1, n // 2 - 1, n - 4]}, **extra))


def bench_dirs(out, logs, shape="8b"):
    """A benchmark's result and log folders made, and its models written under the logs."""
    os.makedirs(out, exist_ok=True)
    os.makedirs(logs, exist_ok=True)
    return write_models(os.path.join(logs, "models"), shape)
