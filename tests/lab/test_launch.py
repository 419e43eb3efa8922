"""The command that starts llmstep's child processes names the device and dtype for every one of them, chosen once:
checked on a CPU by telling PyTorch how many GPUs it has."""

from __future__ import annotations

import sys

import pytest
import torch

from llmstep.lab import launch


def gpus(monkeypatch, n: int, major: int = 9):
    """A machine with n CUDA GPUs of compute capability major.0, as torch.cuda sees them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"major": major})())
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda i: True)
    monkeypatch.setattr(torch.version, "hip", None)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_two_ranks_on_a_one_gpu_machine_run_on_the_cpu_with_gloo_and_float32(monkeypatch):
    gpus(monkeypatch, 1)
    assert launch.rank_device(2) == torch.device("cpu") and launch.backend(launch.rank_device(2)) == "gloo"
    argv = launch.llmstep_command(["generate", "--prompt", "ROMEO:"], ranks=2)
    assert argv[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert argv[5:9] == ["-m", "llmstep", "generate", "--prompt"]
    assert (flag(argv, "--device"), flag(argv, "--dtype")) == ("cpu", "float32")


def test_ranks_take_cuda_and_nccl_only_when_each_has_a_gpu(monkeypatch):
    gpus(monkeypatch, 2)
    assert launch.rank_device(1) == launch.rank_device(2) == torch.device("cuda")
    assert launch.backend(launch.rank_device(2)) == "nccl" and launch.rank_device(3) == torch.device("cpu")
    argv = launch.llmstep_command(["bench"], ranks=2)
    assert (flag(argv, "--device"), flag(argv, "--dtype")) == ("cuda", "bfloat16")
    with pytest.raises(ValueError, match="3 ranks on CUDA need a GPU each; this machine has 2"):
        launch.rank_device(3, "cuda")


def test_a_gpu_without_native_bfloat16_runs_float16(monkeypatch):
    gpus(monkeypatch, 1, major=7)  # a T4 or V100: bf16 only emulated
    assert flag(launch.llmstep_command(["generate"], ranks=1), "--dtype") == "float16"


def test_one_process_is_a_plain_child_told_its_device_and_dtype(monkeypatch):
    gpus(monkeypatch, 0)
    argv = launch.llmstep_command(["generate", "--prompt", "x"], device="cpu", dtype=torch.bfloat16)
    assert argv == [sys.executable, "-m", "llmstep", "generate", "--prompt", "x", "--device", "cpu",
                    "--dtype", "bfloat16"]
    with pytest.raises(ValueError, match="--device in args: pass device="):
        launch.llmstep_command(["generate", "--device", "cuda"], ranks=2)


def test_a_script_runs_under_the_same_launcher_and_names_its_own_device():
    assert launch.launcher(1) == [sys.executable]
    assert launch.launcher(3, python="py") == ["py", "-m", "torch.distributed.run", "--standalone",
                                               "--nproc-per-node=3"]
