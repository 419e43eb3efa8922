"""llmstep: what happens when a LLaMA-3-class model generates one token.

The stages, in the order a token meets them:
    tokens.py     text <-> ids (tokenizers, Llama 3 special tokens and chat format)
    model.py      embedding, the stack of blocks, final norm, LM head   (Llama, Block)
    rope.py       rotary position embedding with Llama 3.1 scaling
    norm.py       RMSNorm
    attention.py  grouped-query attention and the KV cache
    mlp.py        SwiGLU feed-forward
    sampling.py   temperature, top-k, top-p, softmax, the categorical draw
    generate.py   prefill once, decode token by token
Around them: config.py (shapes, presets), cost.py (bytes and FLOPs per token), checkpoint.py
(Hugging Face layout in and out), device.py, cli.py.

Measuring the memory wall: hardware.py (bandwidth, matmul throughput, datasheets, decode ceilings),
roofline.py, trace.py (the one-token trace), bench.py (`llmstep bench`).
Answers to it: quantize.py (int8/int4 weight-only), fast.py (static cache, compiled decode step),
speculative.py (draft-and-verify decoding that keeps the target's distribution), batching.py (continuous
batching: one decode step serves many requests).
The default model: data.py (the Shakespeare corpus, tokenizer), train.py, eval.py.
"""

from . import sampling
from .attention import KVCache
from .checkpoint import CheckpointError, load, load_model, save
from .config import ConfigError, LlamaConfig, RopeScaling
from .generate import Generation, generate, stream
from .model import Llama
from .speculative import LayerSkipDraft, SpeculativeGeneration, speculative_generate, speculative_stream
from .tokens import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ConfigError", "Generation", "KVCache", "LayerSkipDraft", "Llama", "LlamaConfig", "RopeScaling",
    "SpeculativeGeneration", "Tokenizer", "generate", "load", "load_model", "sampling", "save", "speculative_generate",
    "speculative_stream", "stream",
]
