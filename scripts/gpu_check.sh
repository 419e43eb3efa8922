#!/usr/bin/env bash
# The GPU half of issue 5, in one go (< 9 minutes on one H200): run from the repository root on a CUDA machine.
#
#   bash scripts/gpu_check.sh            # writes results/bench_gpu.json and prints both tables
#
# 1. correctness on CUDA (~1 min): the compiled decode step (torch.compile, mode="reduce-overhead", i.e. CUDA
#    graphs) gives the eager tokens; the int4 layers really use torch._weight_int4pack_mm (tinygemm) and int8 the
#    dequantise+matmul that compile fuses; a quantised checkpoint round-trips on the GPU.
# 2. the benchmark (~5 min): Llama-3.1-8B's shape with random weights in bf16, batch 1, prompt 128, 256 new
#    tokens, bf16 / int8 / int4 (g=64) compiled, next to transformers' generate() on the same bf16 weights.
#    Targets: bf16 >= 225 tok/s, int8 >= 1.7x bf16, int4 >= 2.5x bf16.
# 3. speculative decoding (~2 min, issue 6): the shipped pair in bf16, greedy, the compiled loops (CUDA graphs),
#    target alone against k = 2, 4, 6; writes results/speculative_gpu.json.
# 4. continuous batching (~1 min): see the end of this script; writes results/batching_gpu.json.
set -euo pipefail
PY=${PYTHON:-python}
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p results
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU here'; print(torch.__version__, torch.cuda.get_device_name())"

timeout 150 "$PY" - <<'PY'
import tempfile, time
import torch
from llmstep import LlamaConfig
from llmstep.lab.hardware import random_model
from llmstep.fast import FastDecoder
import llmstep
from llmstep.core.quantize import Int4Linear, QuantConfig, quantize

cfg = LlamaConfig(vocab_size=2048, dim=512, n_layers=4, n_heads=8, n_kv_heads=2, hidden_dim=1536, max_seq_len=256)
for dtype in (torch.float32, torch.bfloat16):
    model = random_model(cfg, "cuda", dtype, seed=0)
    prompt = list(range(1, 17))
    eager = FastDecoder(model, max_len=96, compile=False).generate(prompt, 64)
    start = time.perf_counter()
    fast = FastDecoder(model, max_len=96, compile=True)
    fast.warmup()
    got = fast.generate(prompt, 64)
    same = sum(a == b for a, b in zip(got.tokens, eager.tokens))
    print(f"{dtype}: compiled (CUDA graphs: {fast.cuda_graphs}) in {time.perf_counter() - start:.0f} s, "
          f"{same}/64 tokens equal to eager, {got.decode_tokens_per_second:.0f} vs {eager.decode_tokens_per_second:.0f} tok/s")
    if dtype == torch.float32:
        assert got.tokens == eager.tokens, "compiled float32 tokens differ from eager"
model = random_model(cfg, "cuda", torch.bfloat16, seed=0)
q4 = quantize(model, QuantConfig("int4", 64), inplace=False)
kernels = {m.kernel for m in q4.modules() if isinstance(m, Int4Linear)}
print("int4 kernels on CUDA:", kernels)
assert kernels == {"packed"}, "torch._weight_int4pack_mm was not usable: int4 falls back to dequantise+matmul"
with tempfile.TemporaryDirectory() as d:
    llmstep.save(q4, d)
    back = llmstep.load_model(d, device="cuda", dtype=torch.bfloat16)
    assert back.quantization == QuantConfig("int4", 64), back.quantization
    x = torch.randint(0, 2048, (1, 32), device="cuda")
    assert torch.equal(back(x), q4(x)), "quantised checkpoint round trip changed the logits"
print("correctness checks passed")
PY

timeout 420 "$PY" -m llmstep bench --preset llama-3.1-8b --set max_seq_len=4096 --dtype bfloat16 --device cuda \
    --prompt-len 128 --new-tokens 256 --repeats 2 --quantize none int8 int4 --group-size 64 --compile --no-eager \
    --json results/bench_gpu.json
"$PY" - <<'PY'
import json
rows = {r["quantization"]: r for r in json.load(open("results/bench_gpu.json"))["rows"] if r["implementation"] == "llmstep"}
bf16 = rows["none"]["decode_tokens_per_s"]
print(f"bf16 {bf16:.0f} tok/s (target >= 225): {'PASS' if bf16 >= 225 else 'FAIL'}")
for q, target in (("int8", 1.7), ("int4", 2.5)):
    x = rows[q]["decode_tokens_per_s"] / bf16
    print(f"{q} {rows[q]['decode_tokens_per_s']:.0f} tok/s = {x:.2f}x bf16 (target >= {target}x): {'PASS' if x >= target else 'FAIL'}")
PY

timeout 200 "$PY" -m llmstep speculative --bench --compile --device cuda --dtype bfloat16 --ks 2,4,6 --repeats 2 \
    --out results/speculative_gpu.json

# 4. continuous batching (~1 min): the shipped target in bf16 on CUDA, eager, static vs continuous on a random
#    workload, and one decode step against the batch size; writes results/batching_gpu.json.
timeout 120 "$PY" -m llmstep batch --device cuda --dtype bfloat16 --no-compile --slots 1,8,32 --requests 64 \
    --rate 2 --batch-sizes 1,4,16,64,256 --json results/batching_gpu.json
