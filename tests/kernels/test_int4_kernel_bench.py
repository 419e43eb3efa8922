"""scripts/int4_kernel_bench.py: cpu_gemm's AVX2 int4 kernel timed alone, its sums checked against float64 ones
(a broken kernel must show as a large error, not as a fast one), its shapes checked before anything compiles."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import import_script

from llmstep.kernels import cpu_gemm, cpu_int4
from llmstep.lab import runinfo

needs_avx2 = pytest.mark.skipif(shutil.which("g++") is None or "avx2" not in runinfo.cpu_flags(),
                                reason="needs g++ and an AVX2 CPU")
needs_avx512_bf16 = pytest.mark.skipif(shutil.which("g++") is None or "avx512_bf16" not in runinfo.cpu_flags(),
                                       reason="needs g++ and a CPU with AVX-512 BF16")


def load():
    return import_script("int4_kernel_bench.py")


@needs_avx2
def test_the_kernel_alone_is_timed_and_its_sums_are_float64s(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert load().main(["--shapes", "64,128", "96,64", "--repeats", "1", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["kernel"] == cpu_gemm.INT4_KERNEL_NAME and record["machine"]["threads"] == 1
    assert [(r["N"], r["K"]) for r in record["shapes"]] == [(64, 128), (96, 64)]
    for r in record["shapes"]:
        assert r["microseconds"] > 0 and r["error_over_terms"] < 1e-6  # float32 sums of exact products
    assert "one layer's int4 matmuls" in capsys.readouterr().out


@needs_avx2
def test_the_avx2_kernel_alone_takes_k_in_two_calls_split_mid_group(tmp_path):
    out = tmp_path / "k.json"
    for extra in (["--group-size", "6", "--k-split", "33"], ["--k-split", "48"]):
        load().main(["--shapes", "64,96", *extra, "--repeats", "1", "--json", str(out)])
        record = json.loads(out.read_text())
        assert record["k_split"] == int(extra[-1]) and record["shapes"][0]["error_over_terms"] < 1e-6, extra


@needs_avx2
def test_a_kernel_that_reads_the_high_nibbles_wrong_shows_its_error(tmp_path):
    broken = cpu_int4.AVX2.replace("_mm256_srli_epi32(bytes, 4)", "_mm256_srli_epi32(bytes, 3)")
    assert broken != cpu_int4.AVX2
    (tmp_path / "broken.cpp").write_text(broken)
    out = tmp_path / "k.json"
    load().main(["--kernel", str(tmp_path / "broken.cpp"), "--shapes", "64,128", "--repeats", "1", "--json", str(out)])
    assert json.loads(out.read_text())["shapes"][0]["error_over_terms"] > 1e-3


@needs_avx512_bf16
def test_the_avx512_kernel_alone_reads_64_column_blocks_and_sums_as_float64s(tmp_path):
    out = tmp_path / "k.json"
    args = ["--layout", "avx512", "--shapes", "128,128", "64,96", "--repeats", "1", "--json", str(out)]
    assert load().main(args) == 0
    record = json.loads(out.read_text())
    assert record["kernel"] == cpu_gemm.INT4_AVX512_KERNEL_NAME and record["layout"] == "avx512"
    for r in record["shapes"]:
        assert r["microseconds"] > 0 and r["error_over_terms"] < 1e-6, r
    # 3 row pairs a group (one outside the two chains); k in two calls split at 33, mid-group and odd: the first
    # call ends on a group's odd tail, the second starts mid-group (k_start 33) and adds to the first's output
    for extra in (["--group-size", "6"], ["--group-size", "6", "--k-split", "33"], ["--k-split", "48"]):
        load().main(["--layout", "avx512", "--shapes", "64,96", *extra, "--repeats", "1", "--json", str(out)])
        assert all(r["error_over_terms"] < 1e-6 for r in json.loads(out.read_text())["shapes"]), extra
    broken = cpu_int4.AVX512.replace("_mm512_srli_epi16(p1, 4)", "_mm512_srli_epi16(p1, 3)")
    assert broken != cpu_int4.AVX512
    (tmp_path / "broken.cpp").write_text(broken)
    load().main(["--layout", "avx512", "--kernel", str(tmp_path / "broken.cpp"), "--shapes", "64,128", "--repeats",
                 "1", "--json", str(out)])
    assert json.loads(out.read_text())["shapes"][0]["error_over_terms"] > 1e-3


def test_shapes_the_kernel_cannot_take_are_refused_before_compiling(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        load().main(["--shapes", "64,96", "--k-split", "96"])
    assert "--k-split must be at least 0 and below every shape's K, got 96" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load().main(["--group-size", "0"])
    assert "--group-size must be a positive integer, got 0" in capsys.readouterr().err
    script = load()
    monkeypatch.setattr(script.runinfo, "cpu_flags", lambda: ["avx2"])
    if shutil.which("g++"):
        with pytest.raises(SystemExit):
            script.main(["--layout", "avx512", "--shapes", "64,96"])
        assert "the avx512 kernel needs a CPU with avx512_bf16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load().main(["--layout", "avx512", "--shapes", "96,128"])  # N not whole 64-column blocks
    assert "N a multiple of 64 and K of the group size 32: [(96, 128)]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load().main(["--shapes", "48,128"])  # N not whole 32-column blocks
    assert "N a multiple of 32 and K of the group size 32: [(48, 128)]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load().main(["--shapes", "64,96", "--group-size", "64"])
    assert "[(64, 96)]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load().main(["--repeats", "0"])
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load().main(["--shapes", "64x128"])
    assert "a shape is N,K (two integers), got '64x128'" in capsys.readouterr().err
