"""The test-only oracle for GGUF files: transformers' LlamaForCausalLM built from a file's weights, dequantized by
gguf-py (llama.cpp's reader), its q/k rows put back as GGUF-NOTES describes; nothing of llmstep's reader is used."""

from __future__ import annotations

import numpy as np
import torch


def reference_logits(path, ids: list[int]) -> torch.Tensor:
    """The logits [T, vocab] of transformers' LlamaForCausalLM on the file's weights for `ids`."""
    import gguf
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    reader = gguf.GGUFReader(str(path))
    f = {k: v.contents() for k, v in reader.fields.items()}
    n_heads, n_kv = f["llama.attention.head_count"], f["llama.attention.head_count_kv"]
    dim, hidden, layers = f["llama.embedding_length"], f["llama.feed_forward_length"], f["llama.block_count"]
    weights = {}
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape.tolist())]
        weights[t.name] = gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(shape).astype(np.float32)

    def unpermute(w, n):
        rows, cols = w.shape
        return w.reshape(n, rows // n // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)

    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    state = {"model.embed_tokens.weight": weights["token_embd.weight"],
             "model.norm.weight": weights["output_norm.weight"]}
    for i in range(layers):
        for theirs, hf in names.items():
            w = weights[f"blk.{i}.{theirs}.weight"]
            w = unpermute(w, n_heads) if theirs == "attn_q" else unpermute(w, n_kv) if theirs == "attn_k" else w
            state[f"model.layers.{i}.{hf}.weight"] = w
    tied = "output.weight" not in weights
    if not tied:
        state["lm_head.weight"] = weights["output.weight"]
    rope = {"rope_type": "default", "rope_theta": float(f["llama.rope.freq_base"])}
    config = HFConfig(vocab_size=weights["token_embd.weight"].shape[0], hidden_size=dim, intermediate_size=hidden,
                      num_hidden_layers=layers, num_attention_heads=n_heads, num_key_value_heads=n_kv,
                      rms_norm_eps=float(f["llama.attention.layer_norm_rms_epsilon"]), tie_word_embeddings=tied,
                      max_position_embeddings=int(f["llama.context_length"]), rope_parameters=rope)
    hf = LlamaForCausalLM(config).eval()
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=not tied)
    if tied:
        hf.tie_weights()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]



def assert_close_rel(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-4):
    err = (got.double() - want.double()).abs().max() / want.double().abs().max()
    assert err <= rel, f"max error {err:.2e} relative to the largest logit"
