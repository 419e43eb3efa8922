"""The peers of `llmstep bench --peers` (llmstep.lab.peers), each built from a PeerSpec inside its own child process
(llmstep.lab.peer_process): llama.cpp on a GGUF file, CTranslate2 on its conversion of a checkpoint directory,
transformers' generate() on llmstep's own float tensors. Every engine answers run(ids, n) -> (prefill seconds,
decode seconds, the n greedy tokens), timed around the peer's own calls, and carries `info` for the record.

llama.cpp's extra buffer types (weight repacking into layouts for its AMX and other CPU kernels) are turned off
where the parent asks (spec.extra_bufts False: on CPUs with AMX, whose llama.cpp kernels for quantized types can
die with an illegal instruction on virtual machines that advertise AMX without enabling its tile state).
llama-cpp-python's `Llama(...)` has no argument for it, but reads `llama_model_default_params()` once while it
loads; that function is wrapped for the load, to hand back the defaults with `use_extra_bufts = False`. A build
whose model parameters lack the field cannot turn them off, and `info["notes"]` says so.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..core.config import LlamaConfig
from ..core.files import atomic_write_json
from ..core.model import Llama
from . import runinfo
from .bench import hf_twin, time_hf

__all__ = ["PeerSpec", "MAKERS", "LLAMA_FTYPE", "CT2_COMPUTE", "cpu_has_amx", "gguf_step_weight_bytes"]

LLAMA_FTYPE = {"q8_0": 7, "q4_0": 2}  # llama.h's enum llama_ftype: LLAMA_FTYPE_MOSTLY_Q8_0, _Q4_0
GGML_Q8_0 = 8  # ggml.h's enum ggml_type: GGML_TYPE_Q8_0
CT2_COMPUTE = {"float32": "float32", "bfloat16": "bfloat16", "int8": "int8_float32"}  # CTranslate2's compute_type


@dataclass
class PeerSpec:
    """What a child process needs to build one peer at one precision (everything here is pickled to it)."""

    peer: str  # "llama.cpp", "ctranslate2", "transformers" (or a test's fake)
    precision: str  # "float32", "bfloat16", "int8", "int4"
    threads: int
    n_ctx: int  # prompt + new tokens: the context the peer allocates
    weights: str = ""  # what it runs, in a few words ("GGUF q4_1"), for the table
    source: str = ""  # where those weights come from, for the table and record
    requantized: bool = False  # a second rounding of weights the GGUF file already held quantized (lossy)
    # transformers: the model, as llmstep.save wrote it for this peer. A copy, not the parent's tensors sent through
    # the pipe: pickling for another process moves a tensor into shared memory (/dev/shm), in the parent too,
    # which would change how llmstep's own loop reads its weights (and fail where /dev/shm is small).
    model_file: Path | None = None
    dtype: torch.dtype | None = None  # the saved model's dtype, as it is loaded back
    config: LlamaConfig | None = None  # ctranslate2: the model's shape (its bos/eos ids)
    checkpoint: Path | None = None  # ctranslate2: the checkpoint directory its converter reads
    gguf: Path | None = None  # llama.cpp: the file it loads, or (quantize_to) the file its quantiser reads
    quantize_to: str | None = None  # llama.cpp: "q8_0" / "q4_0" made by llama.cpp's quantiser from `gguf` first
    workdir: Path | None = None  # where the peer may write files (conversions, quantised GGUF)
    extra_bufts: bool = True  # llama.cpp: its extra buffer types (weight repacking); False turns them off

    def load_model(self) -> Llama:
        from ..core.checkpoint import load_model

        return load_model(self.model_file, device="cpu", dtype=self.dtype)  # safetensors: no pickle


def cpu_has_amx(cpuinfo: str | None = None) -> bool:
    """Whether the CPU advertises Intel AMX (the `amx_tile` flag of /proc/cpuinfo, or of the text `cpuinfo`)."""
    return "amx_tile" in runinfo.cpu_flags(cpuinfo)


def gguf_step_weight_bytes(path: str | Path) -> int:
    """Bytes of weights one llama.cpp decode step streams from the GGUF file `path`: every tensor as stored, except
    that the token embedding gives one row unless it is also the head (no `output.weight`: tied)."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    emb = tensors.get("token_embd.weight")
    if emb is not None and "output.weight" in tensors:
        rows = int(emb.shape[-1])  # GGUF lists dimensions innermost first: [dim, vocab]
        total -= int(emb.n_bytes) - int(emb.n_bytes) // rows
    return total


# ---- llama.cpp ----------------------------------------------------------------------------------------------

class _LlamaCpp:
    def __init__(self, spec: PeerSpec):
        import llama_cpp

        self.llama_cpp = llama_cpp
        path, notes = spec.gguf, []
        if spec.quantize_to is not None:  # llama.cpp's own quantiser, here in the child: its crash is the peer's
            path = spec.workdir / f"model-{spec.quantize_to}.gguf"
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.nthread = LLAMA_FTYPE[spec.quantize_to], spec.threads
            # The LM head (a tied model's token embedding) in Q8_0 whatever the blocks' type, as llmstep's quantised
            # rows hold theirs in int8 (peer_inputs.head_of); left to itself the quantiser picks Q8_0 or Q6_K by width.
            params.output_tensor_type = GGML_Q8_0
            if llama_cpp.llama_model_quantize(str(spec.gguf).encode(), str(path).encode(), params) != 0:
                raise RuntimeError(f"llama.cpp could not quantise {spec.gguf} to {spec.quantize_to}")
        if not spec.extra_bufts:
            notes.append(_without_extra_bufts(llama_cpp))
        try:
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=spec.n_ctx, n_batch=spec.n_ctx,
                                       n_threads=spec.threads, n_threads_batch=spec.threads, verbose=False, seed=0)
        finally:
            _restore_default_params(llama_cpp)
        self.n_vocab = self.llm.n_vocab()
        self.info = {"name": "llama.cpp (llama-cpp-python)", "version": llama_cpp.__version__,
                     "weights": spec.weights, "source": spec.source, "gguf": str(path), "notes": "; ".join(notes)}

    def _argmax(self) -> int:
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))  # the last token's
        return int(logits.argmax())

    def run(self, ids: list[int], n: int):
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(ids)
        tokens = [self._argmax()]
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(n - 1):
            self.llm.eval(tokens[-1:])
            tokens.append(self._argmax())
        return prefill, time.perf_counter() - start, tokens


_DEFAULT_PARAMS = "_llmstep_default_params"  # where the unwrapped llama_model_default_params waits to be restored


def _without_extra_bufts(llama_cpp) -> str:
    """Make the next Llama(...) load with use_extra_bufts = False (see the module docstring); say what was done."""
    lib = llama_cpp.llama_cpp  # the module llama.py calls llama_model_default_params through
    fields = [name for name, *_ in lib.llama_model_params._fields_]
    if "use_extra_bufts" not in fields:
        return (f"extra buffer types left on: llama-cpp-python {llama_cpp.__version__} has no use_extra_bufts "
                f"in its model parameters")
    default = lib.llama_model_default_params
    setattr(lib, _DEFAULT_PARAMS, default)

    def without():
        params = default()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = without
    return "extra buffer types off (use_extra_bufts = False)"


def _restore_default_params(llama_cpp) -> None:
    lib = llama_cpp.llama_cpp
    if hasattr(lib, _DEFAULT_PARAMS):
        lib.llama_model_default_params = getattr(lib, _DEFAULT_PARAMS)
        delattr(lib, _DEFAULT_PARAMS)


# ---- CTranslate2 --------------------------------------------------------------------------------------------

class _CTranslate2:
    def __init__(self, spec: PeerSpec):
        import ctranslate2
        from ctranslate2.converters import TransformersConverter

        out = spec.workdir / "ctranslate2"
        if not out.exists():
            TransformersConverter(str(spec.checkpoint), low_cpu_mem_usage=True).convert(str(out), force=True)
            vocab = json.loads((out / "vocabulary.json").read_text())  # id -> token string: its input
            # Its converter takes bos/eos from a transformers tokenizer config, which llmstep's checkpoints do not
            # hold; CTranslate2 refuses a null one. Named from the model's config (never used: no stop token).
            config = json.loads((out / "config.json").read_text())
            c = spec.config
            for key, token_id in (("bos_token", c.bos_token_id), ("eos_token", (c.eos_token_id or [None])[0])):
                if config.get(key) is None:
                    config[key] = vocab[token_id if token_id is not None else 0]
            atomic_write_json(out / "config.json", config)
        self.vocab = json.loads((out / "vocabulary.json").read_text())  # id -> token string: CTranslate2's input
        self.generator = ctranslate2.Generator(str(out), device="cpu", compute_type=CT2_COMPUTE[spec.precision],
                                               inter_threads=1, intra_threads=spec.threads)
        self.info = {"name": f"CTranslate2 {ctranslate2.__version__}", "weights": spec.weights, "source": spec.source}

    def run(self, ids: list[int], n: int):
        prompt = [self.vocab[i] for i in ids]
        tokens, start = [], time.perf_counter()
        prefill = 0.0
        for step in self.generator.generate_tokens(prompt, max_length=n, sampling_topk=1, end_token=[]):
            tokens.append(step.token_id)
            if len(tokens) == 1:
                prefill, start = time.perf_counter() - start, time.perf_counter()
            if len(tokens) == n:
                break
        return prefill, time.perf_counter() - start, tokens


# ---- transformers -------------------------------------------------------------------------------------------

class _Transformers:
    def __init__(self, spec: PeerSpec):
        torch.set_num_threads(spec.threads)
        self.hf = hf_twin(spec.load_model())
        self.info = {"name": "transformers generate()", "weights": spec.weights, "source": spec.source}

    def run(self, ids: list[int], n: int):
        first, total, tokens = time_hf(self.hf, torch.tensor([ids]), n)
        return first, total - first, tokens


def make_llama_cpp(spec: PeerSpec):
    return _LlamaCpp(spec)


def make_ctranslate2(spec: PeerSpec):
    return _CTranslate2(spec)


def make_transformers(spec: PeerSpec):
    return _Transformers(spec)


# peer name -> the module-level function a child process calls to build it (pickled by name, so importable)
MAKERS = {"llama.cpp": make_llama_cpp, "ctranslate2": make_ctranslate2, "transformers": make_transformers}
