"""What the GGUF tests share: the test-only oracle (transformers' LlamaForCausalLM built from a file's weights,
dequantized by gguf-py, llama.cpp's reader, its q/k rows put back as GGUF-NOTES describes; nothing of llmstep's
reader is used), a small random model, and llama.cpp's greedy tokens."""

from __future__ import annotations

import numpy as np
import torch

from llmstep.core.config import LlamaConfig
from llmstep.core.model import Llama


def random_llama(**overrides) -> Llama:
    """A random GQA model (8 query heads over 2 kv heads), untied head, norms not 1; `overrides` change the config."""
    kw = dict(vocab_size=300, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=96, max_seq_len=64,
              tie_embeddings=False, torch_dtype="float32")
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**(kw | overrides))).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.uniform_(0.5, 1.5)
    return model


def llama_cpp_greedy(llm, ids: list[int], n: int) -> list[int]:
    """llama.cpp's first `n` greedy tokens after `ids` (llama_cpp.Llama)."""
    got = []
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        got.append(token)
        if len(got) == n:
            return got
    return got


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
