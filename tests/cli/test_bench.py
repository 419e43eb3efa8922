"""`llmstep bench` runs end to end on a tiny random model and writes a complete JSON record."""

import json

import pytest

import llmstep
from llmstep import cli


def main(argv: list[str]) -> dict:
    return cli.main(["bench", *argv])

_RUN = ["--preset", "llama-3.2-1b", "--set", "n_layers=2", "dim=64", "n_heads=4", "n_kv_heads=2", "hidden_dim=128",
        "vocab_size=512", "max_seq_len=64", "--dtype", "float32", "--device", "cpu", "--threads", "1",
        "--prompt-len", "8", "--new-tokens", "16", "--repeats", "1"]  # transformers' 15 steps measurable under load
TINY = [*_RUN, "--bandwidth-bytes", "1048576"]  # with a small bandwidth copy
QUIET = [*_RUN, "--no-bandwidth"]  # without the copy (and so without its size)


def test_bench_writes_valid_json_with_every_variant_and_transformers(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "bench.json"
    main(TINY + ["--quantize", "none", "int8", "int4", "--group-size", "32", "--json", str(out)])
    record = json.loads(out.read_text())
    names = [r["name"] for r in record["rows"]]
    assert names == ["llmstep eager float", "llmstep eager int8", "llmstep eager int4-g32", "transformers generate()"]
    for row in record["rows"]:
        assert row["decode_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0
        assert row["bytes_per_step"] == row["weight_bytes_per_step"] + row["kv_bytes_per_step"]
        assert row["share_of_bandwidth"] > 0 and len(row["tokens"]) == 16
    float_row, int8_row, int4_row, hf_row = record["rows"]
    assert int4_row["weight_bytes_per_step"] < int8_row["weight_bytes_per_step"] < float_row["weight_bytes_per_step"]
    assert hf_row["same_tokens_as_eager_float"]  # transformers, same weights, same greedy tokens
    peers = record["transformers_peers"]  # on a CPU the compiled peer is off unless --hf-compile asks
    assert peers["eager"]["ran"] and not peers["static_compiled"]["ran"]
    assert record["bandwidth_gb_per_s"] > 0 and record["settings"]["prompt_len"] == 8
    assert record["ceiling_gb_per_s"] >= record["read_bandwidth_at_weight_size_gb_per_s"] > 0
    assert record["versions"]["torch"] and record["command"].startswith("llmstep bench --preset")


def test_bench_without_transformers_or_bandwidth_and_bad_settings_exit_with_a_message(tmp_path):
    out = tmp_path / "b.json"
    record = main(QUIET + ["--no-hf", "--json", str(out)])
    assert json.loads(out.read_text())["rows"][0]["name"] == "llmstep eager float"
    assert record["versions"]["llmstep"] == llmstep.__version__ and record["machine"]["dtype"] == "float32"
    assert len(record["load_average_1min_before_after"]) == 2
    with pytest.raises(SystemExit, match="need 108 positions; the model.s context holds 64"):
        main(TINY + ["--no-hf", "--new-tokens", "100"])
    with pytest.raises(SystemExit, match="group_size 48 does not divide"):
        main(TINY + ["--no-hf", "--quantize", "int4", "--group-size", "48"])


def test_the_lm_head_is_quantised_as_asked(capsys):
    """--quantize-lm-head: the head in the blocks' mode; --quantize-lm-head int8: an int8 head under int4 blocks,
    which reads more bytes than an int4 head and fewer than a float one."""
    rows = main(QUIET + ["--no-hf", "--quantize", "int4", "int8", "--group-size", "32",
                        "--quantize-lm-head", "int8"])["rows"]
    assert [r["name"] for r in rows] == ["llmstep eager int4-g32+lm_head-int8", "llmstep eager int8+lm_head"]
    same = main(QUIET + ["--no-hf", "--quantize", "int4", "--group-size", "32",
                        "--quantize-lm-head"])["rows"]
    plain = main(QUIET + ["--no-hf", "--quantize", "int4", "--group-size", "32"])["rows"]
    assert same[0]["name"] == "llmstep eager int4-g32+lm_head"
    # the head's bytes: 512 x 64 weights in float32 (tied: the table), int8 (+ a float32 scale per row) or int4
    # g32 (+ a scale and a zero per group); a quantised head leaves the embedding one float32 row to gather
    float_head, int8_head, int4_head, row = 512 * 64 * 4, 512 * 64 + 512 * 4, 512 * 32 + 2 * 512 * 2 * 4, 64 * 4
    assert rows[0]["weight_bytes_per_step"] - same[0]["weight_bytes_per_step"] == int8_head - int4_head
    assert plain[0]["weight_bytes_per_step"] - rows[0]["weight_bytes_per_step"] == float_head - int8_head - row
    with pytest.raises(SystemExit):
        main(TINY + ["--quantize", "int4", "--quantize-lm-head", "int4"])
    assert "the LM head's own mode can be int8 or int8-a8" in capsys.readouterr().err


def test_transformers_can_run_in_another_dtype_on_the_same_weights(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "bench.json"
    bf16 = [a if a != "float32" else "bfloat16" for a in QUIET]
    main(bf16 + ["--hf-dtype", "float32", "--json", str(out)])
    ours, hf = json.loads(out.read_text())["rows"]
    assert hf["name"] == "transformers generate() float32"
    assert hf["weight_bytes_per_step"] == 2 * ours["weight_bytes_per_step"]  # the same weights, widened
    with pytest.raises(SystemExit, match="int3"):
        main(TINY + ["--hf-dtype", "int3"])


def test_transformers_flags_with_no_hf_are_refused_by_name():
    with pytest.raises(SystemExit, match="--no-hf skips transformers, so --hf-compile has nothing to set"):
        main(TINY + ["--no-hf", "--hf-compile"])
    with pytest.raises(SystemExit, match="--no-hf skips transformers, so --hf-dtype has nothing to set"):
        main(TINY + ["--no-hf", "--hf-dtype", "float32"])


def test_a_size_for_a_bandwidth_copy_that_is_skipped_is_refused():
    with pytest.raises(SystemExit, match="--bandwidth-bytes sizes the bandwidth copy, which --no-bandwidth skips"):
        main(TINY + ["--no-bandwidth"])  # TINY sizes the copy


def test_hf_compile_adds_the_static_cache_row(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from llmstep.lab import bench as decode_bench

    # The compile itself: tests/lab/test_bench_peer.py (slow); here --hf-compile's row on the eager forward.
    kw = decode_bench.static_compiled_generate_kw
    monkeypatch.setattr(decode_bench, "static_compiled_generate_kw", lambda *a: kw(*a) | {"disable_compile": True})
    out = tmp_path / "bench.json"
    main(QUIET + ["--hf-compile", "--json", str(out)])
    record = json.loads(out.read_text())
    assert [r["name"] for r in record["rows"]][1:] == ["transformers generate()", "transformers static cache + compile"]
    assert all(p["ran"] for p in record["transformers_peers"].values())


def test_peers_refuse_a_quantized_lm_head_they_would_not_run(monkeypatch):
    """--peers builds its own int8 / int4 rows, each with an int8 LM head as llama.cpp's quantised inputs have:
    --quantize-lm-head would be ignored there, so it is refused, before the model is built."""
    from llmstep.cli import bench

    monkeypatch.setattr(bench.decode_bench, "bench_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(SystemExit, match="--quantize-lm-head does not apply to --peers"):
        main(TINY + ["--peers", "llama.cpp", "--quantize", "int8", "--quantize-lm-head"])


def test_a_bandwidth_buffer_larger_than_the_free_memory_is_refused_by_name_before_the_model_loads(monkeypatch):
    from llmstep.cli import bench
    from llmstep.core import cost

    monkeypatch.setattr(cost, "free_memory_bytes", lambda device: 2**30)  # 1 GiB free
    monkeypatch.setattr(bench.decode_bench, "bench_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(SystemExit, match=r"--bandwidth-bytes 1,073,741,824 \(the bandwidth copy's 2 buffers"):
        main(TINY + ["--bandwidth-bytes", str(2**30)])


def test_an_int4_a8_row_reads_the_int4_rows_bytes_and_names_its_activations():
    """--quantize int4-a8: int4 weights (the same bytes a step as int4's) with 8-bit activations (llmstep.core.int4a8),
    its own row; --group-size applies to it as to int4, and alone it is enough for one."""
    rows = main(QUIET + ["--no-hf", "--quantize", "int4", "int4-a8", "--group-size", "32"])["rows"]
    assert [r["name"] for r in rows] == ["llmstep eager int4-g32", "llmstep eager int4-g32-a8"]
    assert rows[0]["weight_bytes_per_step"] == rows[1]["weight_bytes_per_step"]
    from llmstep.kernels import cpu_int4a8  # the record names what the matmuls ran: the kernel, or torch's ops

    assert "a8_matmul" not in rows[0] and rows[1]["a8_matmul"] == (
        f"{cpu_int4a8.ops().name}::mm" if cpu_int4a8.installed() else "torch ops")
    assert len(rows[1]["tokens"]) == 16
    assert main(QUIET + ["--no-hf", "--quantize", "int4-a8", "--group-size", "64"])["rows"][0][
        "name"] == "llmstep eager int4-g64-a8"
    with pytest.raises(SystemExit, match="not a multiple of 32"):
        main(TINY + ["--no-hf", "--quantize", "int4-a8", "--group-size", "16"])


def test_an_int8_a8_row_reads_the_int8_rows_bytes_and_names_its_kernel():
    """--quantize int8-a8: int8 weights (the same bytes a step as int8's) with 8-bit activations (llmstep.core.int8a8),
    its own row, naming what its matmuls ran; --group-size is int4's alone."""
    rows = main(QUIET + ["--no-hf", "--quantize", "int8", "int8-a8"])["rows"]
    assert [r["name"] for r in rows] == ["llmstep eager int8", "llmstep eager int8-a8"]
    assert rows[0]["weight_bytes_per_step"] == rows[1]["weight_bytes_per_step"]
    from llmstep.kernels import cpu_int4a8

    assert "a8_matmul" not in rows[0] and rows[1]["a8_matmul"] == (
        f"{cpu_int4a8.ops().name}::mm8" if cpu_int4a8.installed() else "torch ops")
    with pytest.raises(SystemExit, match="--group-size sets int4's groups"):
        main(TINY + ["--no-hf", "--quantize", "int8-a8", "--group-size", "32"])


def test_a_quantized_checkpoint_asked_to_quantize_again_is_refused_not_measured_as_it_is(tmp_path, tiny_checkpoint):
    import llmstep
    from llmstep.core import checkpoint
    from llmstep.core.quantize import quantize

    model, tokenizer = llmstep.load(tiny_checkpoint, device="cpu", dtype="float32")
    path = checkpoint.save(quantize(model, "int8"), tmp_path / "int8", tokenizer)
    with pytest.raises(SystemExit, match=r"is quantized already \(int8\): it is measured as it is; drop --quantize "
                                         "int4"):
        main(["--model", str(path), "--quantize", "int4", "--no-hf", "--no-bandwidth", "--repeats", "1",
              "--prompt-len", "8", "--new-tokens", "4"])
