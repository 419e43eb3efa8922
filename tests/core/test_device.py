"""The dtype policy, checked on a CPU by telling PyTorch what GPU it has."""

import pytest
import torch

from llmstep.core import device as dev


def gpu(monkeypatch, major: int):
    """A CUDA GPU of compute capability major.0, as torch.cuda.is_bf16_supported sees it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"major": major})())
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda i: True)  # emulation works everywhere
    monkeypatch.setattr(torch.version, "hip", None)


@pytest.mark.parametrize("major, expected", [(9, torch.bfloat16), (8, torch.bfloat16), (7, torch.float16)])
def test_bfloat16_only_where_the_gpu_has_it(monkeypatch, major, expected):
    gpu(monkeypatch, major)
    cuda = torch.device("cuda")
    assert dev.native_bf16(cuda) == (major >= 8)
    assert dev.resolve_dtype(None, cuda, stored="bfloat16") == expected
    assert dev.resolve_dtype(None, cuda, stored="float16") == torch.float16
    assert dev.resolve_dtype("bfloat16", cuda) == torch.bfloat16  # asked for by name: given, emulated or not


def test_the_cpu_gets_float32_and_mps_float16():
    assert dev.resolve_dtype(None, torch.device("cpu"), stored="bfloat16") == torch.float32
    assert dev.resolve_dtype(None, torch.device("mps"), stored="bfloat16") == torch.float16
    assert not dev.native_bf16(torch.device("cpu"))


@pytest.mark.parametrize("major, expected", [(9, torch.bfloat16), (8, torch.bfloat16), (7, torch.float16)])
def test_the_half_dtype_a_gpu_is_measured_in_is_float16_where_bfloat16_is_emulated(monkeypatch, major, expected):
    """Notebooks 00 and 05 measure a GPU's 16-bit speed in `half_dtype`: a T4 (7.5) in float16, not emulated bf16."""
    gpu(monkeypatch, major)
    assert torch.cuda.is_bf16_supported(including_emulation=True)  # what a bf16 check that allows emulation says
    assert dev.half_dtype("cuda") == dev.half_dtype(torch.device("cuda", 0)) == expected


def test_the_half_dtype_is_bfloat16_on_the_cpu_and_float16_on_mps():
    assert dev.half_dtype("cpu") == torch.bfloat16
    assert dev.half_dtype("mps") == torch.float16


def _cache(root, index: int, size: str, kind: str):
    d = root / f"index{index}"
    d.mkdir()
    (d / "size").write_text(f"{size}\n")
    (d / "type").write_text(f"{kind}\n")


def test_the_last_level_cache_is_the_largest_data_or_unified_cache_linux_lists(tmp_path):
    _cache(tmp_path, 0, "32K", "Data")
    _cache(tmp_path, 1, "64M", "Instruction")  # an instruction cache holds no weights, however large
    _cache(tmp_path, 2, "1024K", "Unified")
    _cache(tmp_path, 3, "32768K", "Unified")
    for i, size in enumerate(["lots", "", "\u00b2M", "-5K"], start=4):  # sizes that cannot be read are no sizes
        _cache(tmp_path, i, size, "Unified")
    assert dev.last_level_cache(tmp_path) == 32 * 2**20
    (tmp_path / "index8").mkdir()  # a level without its files (a container's partial sysfs)
    _cache(tmp_path, 9, "1G", "Unified")
    (tmp_path / "index9" / "type").write_bytes(b"\xff\xfe")  # not text: skipped, not raised
    assert dev.last_level_cache(tmp_path) == 32 * 2**20
    _cache(tmp_path, 10, "1G", "Unified")
    assert dev.last_level_cache(tmp_path) == 2**30
    assert dev.last_level_cache(tmp_path / "missing") is None
    assert dev.last_level_cache(tmp_path / "index0" / "size") is None  # a file, not a folder of caches


@pytest.mark.parametrize("name", ["xpu", "hpu", "meta", "mtia", "privateuseone", "ipu:0"])
def test_a_device_type_llmstep_does_not_run_on_is_refused_by_name(name):
    """torch parses these; loading onto one failed late, as an assertion or as the checkpoint's fault."""
    with pytest.raises(ValueError, match=rf"device '{name}': llmstep runs on cpu, cuda, cuda:N or mps"):
        dev.resolve_device(name)


@pytest.mark.parametrize("name", ["gpu", "cuda:x", 3.5])
def test_an_unknown_device_name_is_refused(name):
    with pytest.raises(ValueError, match="unknown device"):
        dev.resolve_device(name)


@pytest.mark.parametrize("major", [9, 8, 7])
def test_training_and_the_run_record_call_bfloat16_native_only_where_the_gpu_has_it(monkeypatch, major):
    """A T4 or V100 (7.x) emulates bf16: training runs it in float32, not in slow emulated bf16 autocast, and the
    record's bf16 field says no; the roofline's default matmul dtype is the one the model runs in (half_dtype)."""
    from llmstep.lab import hardware, runinfo
    from llmstep.shakespeare import train

    gpu(monkeypatch, major)
    props = type("P", (), {"major": major, "minor": 0, "name": f"GPU {major}.0", "total_memory": 16e9,
                           "multi_processor_count": 40})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    cuda = torch.device("cuda")
    assert isinstance(train.autocast(cuda), torch.autocast) == (major >= 8)
    assert runinfo.describe(cuda)["bf16"] == (major >= 8)
    asked = []

    def no_gpu_here(size, device, what):  # the memory check before the matmul's tensors: record what, stop there
        asked.append(what)
        raise RuntimeError("stop")

    monkeypatch.setattr(hardware.torch, "Generator", lambda device: type("G", (), {"manual_seed": lambda g, s: g})())
    monkeypatch.setattr(hardware, "check_fits", no_gpu_here)
    with pytest.raises(RuntimeError, match="stop"):
        hardware.measure_matmul(cuda, n=64)
    assert asked[0].endswith("in " + str(torch.bfloat16 if major >= 8 else torch.float16) + " (three 64 x 64 matrices)")
