"""llmstep.hardware: the article's RTX 4090 arithmetic reproduced, the datasheets, and the two probes."""

import pytest
import torch

from llmstep import Llama, LlamaConfig
from llmstep.core.cost import decode_step_cost, n_params
from llmstep.lab.hardware import (
    DATASHEETS,
    Chip,
    article_ceiling,
    ceiling_table,
    decode_ceiling,
    describe,
    measure_bandwidth,
    measure_matmul,
    measured_chip,
    random_model,
)
from llmstep.lab.roofline import attainable_tflops


def test_article_numbers_for_the_rtx_4090_are_reproduced_from_its_round_figures():
    c = article_ceiling("RTX 4090")  # 8 B params x 2 bytes = 16 GB, 2 FLOPs per param, 82.6 TFLOP/s
    assert c.bytes_per_token == 16e9
    assert round(c.ms_per_token, 2) == 15.87
    assert round(c.tokens_per_second) == 63
    assert round(c.achieved_tflops, 3) == 1.008
    assert round(100 * c.utilisation, 2) == 1.22


def test_the_4090_tensor_core_rate_halves_the_busy_share():
    # the same bytes and FLOPs per token, measured against the tensor cores' 165.2 TFLOP/s instead of 82.6
    plain, tensor = article_ceiling("RTX 4090"), article_ceiling("RTX 4090", peak="tensor")
    assert tensor.tokens_per_second == plain.tokens_per_second
    assert tensor.utilisation == pytest.approx(plain.utilisation / 2)
    assert round(100 * tensor.utilisation, 2) == 0.61


def test_exact_llama_3_8b_figures_come_from_the_config():
    cfg = LlamaConfig.preset("llama-3-8b")
    assert round(n_params(cfg) / 1e9, 2) == 8.03
    assert round(2 * n_params(cfg) / 1e9, 2) == 16.06  # bf16 on disk
    c = decode_ceiling(cfg, "RTX 4090", peak="non_tensor")
    # the 1.05 GB input embedding is gathered (one row), not streamed: ~15.0 GB per token
    assert c.bytes_per_token == decode_step_cost(cfg).bytes
    assert 14.9e9 < c.bytes_per_token < 15.1e9
    assert 14.8 < c.ms_per_token < 15.0 and 66 < c.tokens_per_second < 68
    assert round(100 * c.utilisation, 2) == 1.22  # ~2 FLOPs per byte-pair either way


def test_ceiling_table_covers_every_datasheet_chip_and_faster_memory_means_more_tokens():
    rows = ceiling_table(LlamaConfig.preset("llama-3.1-8b"))
    assert [r.chip for r in rows] == list(DATASHEETS)
    rates = [r.tokens_per_second for r in rows]
    assert rates == sorted(rates)
    assert all(r.utilisation < 0.02 for r in rows)
    assert set(rows[0].row()) >= {"chip", "ms/token", "tokens/s", "utilisation %"}


def test_ridge_point_is_flops_per_byte():
    assert DATASHEETS["H100 SXM"].ridge_point() == pytest.approx(989.4e12 / 3350e9)


def test_bad_arguments_are_rejected_with_the_name():
    with pytest.raises(KeyError, match="unknown chip"):
        article_ceiling("RTX 9090")
    with pytest.raises(ValueError, match="peak"):
        article_ceiling(peak="sparse")
    with pytest.raises(ValueError, match="non-tensor"):
        article_ceiling("H200 SXM", peak="non_tensor")
    with pytest.raises(ValueError, match="context"):
        decode_ceiling(LlamaConfig.preset("llama-3-8b"), "H100 SXM", context=-1)
    with pytest.raises(ValueError, match="nbytes"):
        measure_bandwidth("cpu", nbytes=0)
    with pytest.raises(ValueError, match="repeats"):
        measure_bandwidth("cpu", nbytes=1024, repeats=0)
    with pytest.raises(ValueError, match="kind must be 'copy' or 'read', got 'write'"):
        measure_bandwidth("cpu", nbytes=1024, kind="write")
    with pytest.raises(ValueError, match="n must"):
        measure_matmul("cpu", n=-4)
    with pytest.raises(ValueError, match="dtype"):
        measure_matmul("cpu", dtype=torch.int32, n=8)
    with pytest.raises(ValueError, match="positive"):
        measured_chip("cpu", bandwidth_gb_per_s=0.0, matmul_tflops=1.0)


def test_a_bandwidth_buffer_the_free_memory_cannot_hold_is_refused_before_it_is_allocated(monkeypatch):
    from llmstep.core import cost

    monkeypatch.setattr(cost, "free_memory_bytes", lambda device: 3 * 2**30)  # 3 GiB free
    monkeypatch.setattr(torch, "ones", lambda *a, **k: pytest.fail("the buffer was allocated"))
    with pytest.raises(cost.MemoryBudgetError, match=r"nbytes 2,147,483,648 \(the bandwidth copy's 2 buffers"):
        measure_bandwidth("cpu", nbytes=2**31)  # a copy holds two: 4 GiB
    with pytest.raises(cost.MemoryBudgetError, match=r"nbytes 4,294,967,296 \(the bandwidth read's 1 buffer "):
        measure_bandwidth("cpu", nbytes=2**32, kind="read")
    monkeypatch.setattr(torch, "randn", lambda *a, **k: pytest.fail("a matrix was allocated"))
    with pytest.raises(cost.MemoryBudgetError, match=r"measure_matmul's n = 20,000 in torch.float32 \(three"):
        measure_matmul("cpu", n=20_000)  # 4.8 GB
    with pytest.raises(cost.MemoryBudgetError, match=r"measure_matmul's shape \(1, 2000000, 1000\)"):
        measure_matmul("cpu", shape=(1, 2_000_000, 1000))  # 8 GB of weight


def test_probes_return_positive_rates_on_the_cpu():
    assert measure_bandwidth("cpu", nbytes=2**22, repeats=2) > 0
    assert measure_bandwidth("cpu", nbytes=2**22, repeats=2, kind="read") > 0
    assert measure_matmul("cpu", n=128, repeats=2) > 0
    chip = measured_chip("cpu", bandwidth_gb_per_s=10.0, matmul_tflops=0.5)
    assert isinstance(chip, Chip) and chip.source == "measured"
    assert decode_ceiling(LlamaConfig.preset("llama-3.2-1b"), chip).ms_per_token > 0


def test_describe_names_the_device():
    info = describe("cpu")
    assert info["device"] == "cpu" and info["name"]


def test_random_model_has_the_shape_and_dtype_asked_and_keeps_the_tie():
    cfg = LlamaConfig(vocab_size=300, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=112,
                      max_seq_len=64, tie_embeddings=True)
    model = random_model(cfg, "cpu", torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.inv_freq.dtype == torch.float32
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.equal(model.inv_freq, Llama(cfg).inv_freq)
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).float()).all()


def test_roofline_is_the_lower_of_the_two_ceilings():
    chip = DATASHEETS["RTX 4090"]
    assert attainable_tflops(chip, 1.0) == pytest.approx(1.008)  # memory-bound: 1,008 GB/s x 1 FLOP/byte
    assert attainable_tflops(chip, 1e4) == chip.tensor_tflops
    with pytest.raises(ValueError, match="intensity"):
        attainable_tflops(chip, 0)


def test_matmul_of_a_given_shape_is_timed_as_nn_linear_multiplies_and_counts_its_own_flops(monkeypatch):
    # A roofline's compute roof is measured on its points' shape ([T x d] @ [d x n], the weight transposed as
    # nn.Linear holds it): 2 T d n FLOPs over the fastest run, not a square product's 2 n^3.
    from llmstep.lab import hardware

    timed = []

    def fake_time_repeats(fn, device, repeats):
        timed.append(fn())  # the product each timed run makes
        return [0.5, 0.25, 0.75][:repeats]

    monkeypatch.setattr(hardware, "time_repeats", fake_time_repeats)
    tflops = measure_matmul("cpu", torch.float32, repeats=3, shape=(4, 8, 16))
    assert tflops == 2 * 4 * 8 * 16 / 0.25 / 1e12  # the fastest of the runs counts
    assert timed[0].shape == (4, 16)  # [m, k] @ [k, n] -> [m, n]
    assert measure_matmul("cpu", torch.float32, n=8, repeats=2) == 2 * 8**3 / 0.25 / 1e12  # the square, as before
    with pytest.raises(ValueError, match="not both"):
        measure_matmul("cpu", n=8, shape=(4, 8, 16))
    with pytest.raises(ValueError, match="shape's k"):
        measure_matmul("cpu", shape=(4, 0, 16))
    with pytest.raises(ValueError, match="tuple"):
        measure_matmul("cpu", shape=(4, 8))


def test_the_default_matmul_size_is_small_where_the_cpu_only_emulates_a_16_bit_product(monkeypatch):
    """A bf16 product on a CPU without avx512_bf16 / amx_bf16 (an AVX2-only one) is emulated, far slower than float32:
    measured at n = 512 by default, where 2048 would take minutes (notebook 00 measures it); natively at 2048."""
    from llmstep.lab import hardware

    cpu = torch.device("cpu")
    for flags, bf16_n in ((["avx2"], 512), (["avx2", "avx512f", "avx512_bf16"], 2048), (["amx_bf16"], 2048)):
        monkeypatch.setattr(hardware, "cpu_flags", lambda flags=flags: flags)
        assert hardware.matmul_size(cpu, torch.bfloat16) == bf16_n
        assert hardware.matmul_size(cpu, torch.float32) == 2048
        assert hardware.matmul_size(cpu, torch.float16) == 512
    assert hardware.matmul_size(torch.device("cuda"), torch.bfloat16) == 8192
    assert hardware.matmul_size(torch.device("mps"), torch.float16) == 2048
