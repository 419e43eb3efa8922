"""Tensor parallelism (llmstep.core.parallel) is the same function as one process.

The multi-process tests run tests/core/tp_worker.py under `torchrun --standalone` on the CPU (gloo): 2 ranks
always (about 15 s), 4 ranks with LLMSTEP_SLOW_TESTS=1 (the machine may have fewer cores than ranks). Three
checkpoints cover MHA, GQA and MQA, tied and untied heads, and vocabularies that 2 or 4 does not divide.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_checkpoint

from llmstep import cli
from llmstep.core import loader, parallel, parallel_split
from llmstep.core.checkpoint import load_model
from llmstep.core.config import LlamaConfig

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("tp_worker.py")
FAILING_RANK = Path(__file__).with_name("tp_failing_rank.py")
SLOW = pytest.mark.skipif(not os.environ.get("LLMSTEP_SLOW_TESTS"),
                          reason="4 processes on a 2-core machine take ~30 s; set LLMSTEP_SLOW_TESTS=1")
# name -> transformers overrides (conftest.hf_config: dim 64, 8 query heads, hidden 112, 2 layers, vocab 300).
CHECKPOINTS = {
    "gqa-untied-vocab301": dict(num_key_value_heads=2, vocab_size=301),  # 301: padded for 2 and 4 ranks
    "mha-tied": dict(num_key_value_heads=8, tie_word_embeddings=True),
    "mqa-untied-vocab302-sharded": dict(num_key_value_heads=1, vocab_size=302, max_shard_size="40KB"),  # 4 pads
}


def torchrun(n: int, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """torchrun with n ranks; past `timeout` seconds torchrun and its ranks are stopped and the test fails: a hung
    run never outlives its test."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "LLMSTEP_DEBUG": ""}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *args]
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun passes SIGTERM on to its ranks (each in a session of its own) and exits
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"torchrun {' '.join(args)} ran past {timeout} s (hung)")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_file) -> dict[str, Path]:
    out = {}
    for i, (name, overrides) in enumerate(CHECKPOINTS.items()):
        path = tmp_path_factory.mktemp(name)
        make_checkpoint(path, tokenizer_file, seed=i, **overrides)
        out[name] = path
    return out


def run_worker(n: int, checkpoints: dict[str, Path], tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp(f"ranks{n}")
    done = torchrun(n, str(WORKER), str(out), *map(str, checkpoints.values()))
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
    assert all(r["world"] == n for r in records)
    return [{name: r["checkpoints"][str(p)] for name, p in checkpoints.items()} for r in records]


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory):
    return run_worker(2, checkpoints, tmp_path_factory)


@pytest.fixture(scope="module")
def four_ranks(checkpoints, tmp_path_factory):
    return run_worker(4, checkpoints, tmp_path_factory)


@pytest.fixture(params=[2, pytest.param(4, marks=SLOW)])
def ranks(request):
    return request.getfixturevalue({2: "two_ranks", 4: "four_ranks"}[request.param])


# ---- under torchrun ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CHECKPOINTS)
def test_logits_match_one_process_within_1e_5(ranks, name):
    for rank in ranks:
        r = rank[name]
        assert r["max_abs_diff"] <= 1e-5, r["max_abs_diff"]  # prefill and 9 cached decode steps, float32
        assert r["logits_shape"] == [1, 1, r["vocab"]]  # the padding is cut off


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_greedy_and_seeded_text_equal_one_process_on_every_rank(ranks, name):
    first = ranks[0][name]
    assert first["greedy_tp"] == first["greedy_full"] and len(first["greedy_tp"]) > 0
    assert first["sampled_tp"] == first["sampled_full"]  # the same seed, the same draws
    assert first["speculative_tp"] == first["greedy_full"]  # the shard drafting for itself, its first layer
    for rank in ranks[1:]:
        assert rank[name]["greedy_tp"] == first["greedy_tp"] and rank[name]["sampled_tp"] == first["sampled_tp"]
        assert rank[name]["drawn_seed"] == first["drawn_seed"]  # seed None: rank 0 draws, every rank uses it


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_each_rank_holds_1_over_n_of_the_layers_matrices(ranks, name):
    """Exactly 1/N of the blocks' matrices per rank, except the KV heads of MQA/GQA when fewer than the ranks:
    each rank then holds one KV head (wk and wv: 2 x head_dim x dim per layer) instead of n_kv/N."""
    n, kv_full = len(ranks), CHECKPOINTS[name].get("num_key_value_heads")
    head_bytes = 2 * 8 * 64 * 4 * 2  # (wk + wv) rows of one head: 2 x head_dim 8 x dim 64 x float32 x 2 layers
    for rank in ranks:
        r = rank[name]
        extra = head_bytes * (1 - kv_full / n) if kv_full < n else 0  # a whole KV head where 1/N of one would do
        assert r["layer_bytes"] == r["full_layer_bytes"] / n + extra
        assert r["layer_bytes"] <= 1.25 * r["full_layer_bytes"] / n  # "about 1/N", even for MQA at 4 ranks
        assert r["kv_heads"] == max(1, kv_full // n) and r["heads"] == 8 // n
        assert r["cache_bytes"] == r["full_cache_bytes"] * r["kv_heads"] // kv_full  # its heads only


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_no_rank_reads_or_holds_the_whole_model(ranks, name):
    """Together the ranks read every byte of the file once, plus what is replicated (the norms, and KV heads
    shared by ranks); each rank reads what it holds, less the vocabulary padding."""
    n = len(ranks)
    kv_full = CHECKPOINTS[name].get("num_key_value_heads")
    norms = (2 * 2 + 1) * 64 * 4
    head_bytes = 2 * 8 * 64 * 4 * 2
    replicated_kv = head_bytes * (n - kv_full) if kv_full < n else 0
    full = ranks[0][name]["full_param_bytes"]
    assert sum(rank[name]["bytes_read"] for rank in ranks) == full + (n - 1) * norms + replicated_kv
    for rank in ranks:
        r = rank[name]
        assert r["bytes_read"] <= r["param_bytes"] < full / n + norms + replicated_kv + 2 * 64 * 4 * 2
        assert r["tied"] == bool(CHECKPOINTS[name].get("tie_word_embeddings"))


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_decode_step_runs_two_all_reduces_per_layer(ranks, name):
    r = ranks[0][name]
    assert r["step_collectives"] == {"all_reduce": 2 * r["n_layers"] + 1, "all_gather": 1}  # + embedding, head


def test_torchrun_generate_prints_what_one_process_prints(checkpoints):
    path = str(checkpoints["gqa-untied-vocab301"])
    argv = ["generate", "--model", path, "--prompt", "Shall I", "--temperature", "0", "--max-new-tokens", "12"]
    one = subprocess.run([sys.executable, "-m", "llmstep", *argv], env=os.environ | {"PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    two = torchrun(2, "-m", "llmstep", *argv)
    assert one.returncode == two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one.stdout and one.stdout.startswith("Shall I")  # rank 0 alone prints: no doubled text
    assert "tensor-parallel over 2 ranks" in two.stderr


def test_a_world_size_that_cannot_split_the_heads_is_refused_before_loading(checkpoints, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoints["mha-tied"], broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # loading would fail: the world size must be refused first
    done = torchrun(3, "-m", "llmstep", "generate", "--model", str(broken), "--prompt", "x")
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("llmstep generate: error:")]
    assert lines == ["llmstep generate: error: cannot split 8 query heads over 3 ranks: the world size must "
                     "divide n_heads (world sizes that split this model: 2, 4, 8)"]  # once: rank 0 speaks for all


def test_a_rank_that_fails_alone_stops_every_rank_with_its_message(checkpoints, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(checkpoints["mha-tied"], broken)
    tensors = load_file(broken / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"  # [64, 64]: column-parallel, rank 1 holds rows 32..63
    tensors[name][40, 3] = float("nan")
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setenv("LLMSTEP_TP_TIMEOUT", "60")  # a bound for today's code too; the agreement needs no wait
    done = torchrun(2, "-m", "llmstep", "generate", "--model", str(broken), "--prompt", "x", timeout=90)
    assert done.returncode != 0, done.stderr[-2000:]  # torchrun exits 1 when a rank fails
    lines = [line for line in done.stderr.splitlines() if line.startswith("llmstep generate:")]
    assert lines == [f"llmstep generate: error: rank 1 of 2: {broken / 'model.safetensors'}: tensor {name} holds "
                     "NaN or Inf values in float32; the checkpoint is damaged"]  # rank 0 says it, for both


@pytest.mark.parametrize("mode, words, within", [
    ("stall", "another rank stopped answering: a collective timed out after 3 s (LLMSTEP_TP_TIMEOUT sets it)", 20),
    ("crash", "another rank of this run has stopped (its connection closed)", 10),
], ids=["stall", "crash"])
def test_a_stalled_or_crashed_rank_ends_the_others_within_the_timeout(monkeypatch, mode, words, within):
    monkeypatch.setenv("LLMSTEP_TP_TIMEOUT", "3")
    # torchrun's agent stops the other ranks once it sees one fail (it looks every 0.1 s by default): a crashed rank
    # 1 could get rank 0 stopped before it printed on a loaded machine; looking every 5 s leaves rank 0 the time
    done = torchrun(2, "--monitor-interval=5", str(FAILING_RANK), mode, timeout=60)
    assert done.stdout.strip(), f"rank 0 printed nothing; torchrun's stderr: {done.stderr[-2000:]}"
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["line"].startswith("ParallelError: " + words), record
    assert record["seconds"] < within


def test_the_collective_timeout_is_bounded_and_settable(monkeypatch):
    monkeypatch.delenv("LLMSTEP_TP_TIMEOUT", raising=False)
    assert parallel.timeout_seconds() == 300
    monkeypatch.setenv("LLMSTEP_TP_TIMEOUT", "2.5")
    assert parallel.timeout_seconds() == 2.5
    for bad in ("0", "-1", "soon", "1e9"):
        monkeypatch.setenv("LLMSTEP_TP_TIMEOUT", bad)
        with pytest.raises(parallel.ParallelError, match=f"LLMSTEP_TP_TIMEOUT is '{bad}'"):
            parallel.timeout_seconds()


def test_torchrun_bench_records_time_and_all_reduce_share(checkpoints, tmp_path):
    out = tmp_path / "tp.json"
    done = torchrun(2, "-m", "llmstep", "bench", "--model", str(checkpoints["mha-tied"]), "--prompt-len", "4",
                    "--new-tokens", "4", "--repeats", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["world_size"] == 2 and len(record["per_rank"]) == 2
    assert 0 < record["all_reduce_share"]["median"] < 1 and record["per_token_seconds"]["median"] > 0
    assert record["all_reduces_per_token"] == 2 * 2 + 1 and record["all_reduce_bytes"] == 64 * 4
    assert done.stdout.count("2 rank(s):") == 1


# ---- in one process ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag", [
    (["generate", "--prompt", "x", "--draft", "draft"], "--draft"),
    (["bench", "--quantize", "int8"], "--quantize int8/int4"),
    (["bench", "--compile"], "--compile"),
])
def test_torchrun_refuses_what_does_not_run_tensor_parallel(monkeypatch, capsys, argv, flag):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"llmstep {argv[0]}: error:") and flag in err and "tensor-parallel" in err


def test_torchrun_bench_refuses_a_window_past_the_context_before_joining_the_group(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(parallel, "init_from_environment", lambda *a: pytest.fail("joined the process group"))
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--prompt-len", "500", "--new-tokens", "100"])  # the shipped model's context: 512
    assert e.value.code == 2 and "--prompt-len 500 and --new-tokens 100" in capsys.readouterr().err


def test_ranks_other_than_0_print_nothing(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", ""])
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("n_heads, n_kv, hidden, world, words", [
    (8, 2, 112, 3, r"cannot split 8 query heads over 3 ranks.*\(world sizes that split this model: 2, 4, 8\)$"),
    (12, 3, 120, 2, r"cannot split 3 KV heads over 2 ranks.*\(world sizes that split this model: 3, 6, 12\)$"),
    (8, 2, 110, 4, r"cannot split the feed-forward's 110 units over 4 ranks.*this model: 2\)$"),
    (6, 2, 112, 4, r"\(world sizes that split this model: 2\)$"),  # 3 and 6 split the heads, not the KV heads
    (8, 2, 112, 0, "positive integer"),
])
def test_check_split_names_what_cannot_be_split(n_heads, n_kv, hidden, world, words):
    config = LlamaConfig(vocab_size=300, dim=96, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv, hidden_dim=hidden)
    with pytest.raises(parallel.ParallelError, match=words):
        parallel.check_split(config, world)


def test_a_vocabulary_small_beside_the_world_gives_the_last_ranks_empty_padded_slices():
    config = LlamaConfig(vocab_size=41, dim=64, n_layers=1, n_heads=8, n_kv_heads=8, hidden_dim=64)
    spans = [parallel_split.rank_slices(config, parallel.split(config, r, 8))["tok_embeddings.weight"]
             for r in range(8)]  # 6 rows a rank: rank 6 holds 5, rank 7 none (its start was 42, past the end)
    assert [stop - start for _, start, stop in spans] == [6] * 6 + [5, 0]
    assert all(0 <= start <= stop <= 41 for _, start, stop in spans)
    rows = torch.arange(41 * 2.0).reshape(41, 2)
    assert parallel_split.pad_rows(rows[spans[7][1]:spans[7][2]], 6).shape == (6, 2)


@pytest.mark.parametrize("n_kv, world", [(1, 2), (1, 4), (2, 4), (2, 2), (8, 4), (4, 8)])
def test_each_rank_holds_the_kv_heads_its_query_heads_read(n_kv, world):
    config = LlamaConfig(vocab_size=300, dim=64, n_layers=1, n_heads=8, n_kv_heads=n_kv, hidden_dim=112 * 8)
    n_rep = 8 // n_kv
    for rank in range(world):
        s = parallel.split(config, rank, world)
        for h in range(rank * s.heads, (rank + 1) * s.heads):  # global query head -> its KV head
            assert s.kv_start <= h // n_rep < s.kv_start + s.kv_heads
            assert (h - rank * s.heads) // (s.heads // s.kv_heads) == h // n_rep - s.kv_start  # as GQA maps it


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rank_slices_tile_every_split_tensor(world):
    config = LlamaConfig(vocab_size=301, dim=48, n_layers=2, n_heads=12, n_kv_heads=12, hidden_dim=120)
    by_rank = [parallel.rank_slices(config, parallel.split(config, r, world)) for r in range(world)]
    sizes = {"attention.wq": 12 * 4, "attention.wo": 12 * 4, "feed_forward.w1": 120, "feed_forward.w2": 120}
    for name, size in sizes.items():
        pieces = [s[f"layers.1.{name}.weight"][1:] for s in by_rank]
        assert pieces == [(r * size // world, (r + 1) * size // world) for r in range(world)]
    vocab = [s["tok_embeddings.weight"][1:] for s in by_rank]
    assert vocab[0][0] == 0 and vocab[-1][1] == 301
    assert all(a[1] == b[0] for a, b in zip(vocab[:-1], vocab[1:], strict=True))  # contiguous, no gap


class _Recorder:
    """safe_open, recording the bytes each rank takes out of the file; get_tensor (the whole tensor) forbidden."""

    taken: list[int] = []

    def __init__(self, *args, **kw):
        from safetensors import safe_open
        self.f = safe_open(*args, **kw)

    def __enter__(self):
        self.inner = self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def get_tensor(self, name):
        raise AssertionError(f"{name} read whole")

    def get_slice(self, name):
        view = self.inner.get_slice(name)
        recorder = self

        class View:
            def __getitem__(self, index):
                t = view[index]
                recorder.taken.append(t.nbytes)
                return t
        return View()


@pytest.mark.parametrize("name", ["gqa-untied-vocab301", "mha-tied"])
def test_load_sharded_takes_only_its_slices_and_equals_shard(checkpoints, monkeypatch, name):
    """In one process, pretending to be rank r of 2: what load_sharded takes out of the files is the rank's
    share (no tensor is read whole), and the model equals `shard` of the whole one."""
    path = checkpoints[name]
    full = load_model(path, device="cpu", dtype="float32")
    whole = sum(p.nbytes for p in full.parameters())
    monkeypatch.setattr(loader, "safe_open", _Recorder)
    monkeypatch.setattr(parallel, "agreeing", lambda group=None: contextlib.nullcontext())  # no other rank to ask
    for rank in range(2):
        monkeypatch.setattr(parallel, "_rank_world", lambda group, rank=rank: (rank, 2))
        _Recorder.taken = []
        tp = parallel.load_sharded(path, device="cpu", dtype="float32")
        assert sum(_Recorder.taken) == tp.bytes_read < 0.56 * whole  # half, plus the replicated norms
        again = parallel.shard(full)
        assert set(tp.state_dict()) == set(again.state_dict())
        for key, value in tp.state_dict().items():
            assert torch.equal(value, again.state_dict()[key]), key
        assert isinstance(tp, parallel.TensorParallelLlama) and tp.rank_config.n_heads == 4


def test_tp_needs_a_process_group():
    with pytest.raises(parallel.ParallelError, match="torchrun"):
        parallel.load_sharded("target")


def test_one_rank_is_the_model_itself_without_collectives(checkpoints, monkeypatch):
    """A world of one: the shard is the whole model (its tensors copied), the same logits to float32 rounding
    (a copied weight may take another matmul kernel path), and no collective runs."""
    full = load_model(checkpoints["mqa-untied-vocab302-sharded"], device="cpu", dtype="float32")
    monkeypatch.setattr(parallel, "_rank_world", lambda group: (0, 1))
    tp = parallel.shard(full)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    cf, ct = full.new_cache(1, 9), tp.new_cache(1, 9)
    torch.testing.assert_close(full(ids, cache=cf), tp(ids, cache=ct), rtol=0, atol=1e-6)
    torch.testing.assert_close(full(ids[:, :1], cache=cf), tp(ids[:, :1], cache=ct), rtol=0, atol=1e-6)
    assert tp.comm.calls == 0 and ct.nbytes == cf.nbytes


def test_a_stray_rank_without_torchrun_silences_nothing(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")  # left over in a shell, or set by another launcher: no WORLD_SIZE
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", ""])
    assert capsys.readouterr().err == "llmstep generate: error: the prompt is empty: give at least one character\n"


@pytest.mark.parametrize("argv", [["info", "--preset", "llama-3.2-1b"], ["export", "--gguf", "x.gguf"],
                                  ["train", "--preset", "tiny", "--steps", "1", "--out", "run"]])
def test_commands_without_tensor_parallelism_are_refused_under_torchrun(monkeypatch, capsys, tmp_path, argv):
    monkeypatch.chdir(tmp_path)  # where a command that ran anyway would write
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"llmstep {argv[0]}: error: {argv[0]} does not run tensor-parallel (only "
                                       "generate and bench do): run it in one process, without torchrun (here "
                                       "WORLD_SIZE is 2)\n")


def test_a_shard_is_not_quantised_and_its_layer_skip_draft_caches_its_heads(checkpoints, monkeypatch):
    """A shard's layers add their partial sums across ranks; a quantised layer would not (wrong logits, no error):
    refused before anything changes. A layer-skip draft of a shard caches this rank's KV heads, as the shard does."""
    from llmstep.core.quantize import QuantizationError, quantize
    from llmstep.engines.drafts import LayerSkipDraft, resolve_draft

    full = load_model(checkpoints["gqa-untied-vocab301"], device="cpu", dtype="float32")
    monkeypatch.setattr(parallel, "agreeing", lambda group=None: contextlib.nullcontext())
    monkeypatch.setattr(parallel, "_rank_world", lambda group: (0, 2))  # rank 0 of 2: shapes only, no forward
    tp = parallel.shard(full)
    before = {k: v.clone() for k, v in tp.state_dict().items()}
    for mode in ("int8", "int4"):
        for inplace in (True, False):
            with pytest.raises(QuantizationError, match="shard of a tensor-parallel model"):
                quantize(tp, mode, inplace=inplace)
    with pytest.raises(QuantizationError, match="shard"):
        resolve_draft("self-int8", tp)
    assert all(torch.equal(v, before[k]) for k, v in tp.state_dict().items()) and not hasattr(tp, "quantization")
    draft = LayerSkipDraft(tp, 1)
    cache, whole = draft.new_cache(1, 8), LayerSkipDraft(full, 1).new_cache(1, 8)
    assert cache.k[0].shape[1] == tp.rank_config.n_kv_heads == 1 and whole.k[0].shape[1] == 2
    assert len(cache.k) == 1
    with pytest.raises(QuantizationError, match="shard"):
        quantize(draft, "int8")


def test_a_cuda_rank_takes_its_own_gpu_and_refuses_another(monkeypatch):
    """Under torchrun each rank's collectives run on cuda:LOCAL_RANK: its model must be there too, so "cuda" becomes
    that GPU and another GPU's index is refused by name (was: rank 1 loaded onto cuda:0, NCCL failing later)."""
    from llmstep.core import process_group

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(process_group.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(process_group.dist, "get_rank", lambda group=None: 1)
    assert process_group.rank_device("cuda") == process_group.rank_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(parallel.ParallelError, match=r"rank 1 was given device cuda:0, but its GPU is cuda:1"):
        process_group.rank_device("cuda:0")
    assert process_group.rank_device("cpu") == torch.device("cpu")


def test_a_cuda_rank_outside_torchrun_is_told_to_set_its_device(monkeypatch):
    """Without LOCAL_RANK a rank's GPU is the current device: "give plain 'cuda'" would land it on that device
    beside another rank, so the refusal names torch.cuda.set_device instead."""
    from llmstep.core import process_group

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(process_group.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(process_group.dist, "get_rank", lambda group=None: 1)
    with pytest.raises(parallel.ParallelError, match=r"cuda:0 \(the current device\): torch.cuda.set_device"):
        process_group.rank_device("cuda:1")
