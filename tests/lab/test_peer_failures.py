"""A peer that crashes costs its own row, not the benchmark (llmstep.lab.peer_process): each peer runs in a child
process, a signal or an exception there is recorded under `failed` with what happened and when, and the other
engines' rows still come. llama.cpp's extra buffer types are turned off where the CPU has AMX."""

from __future__ import annotations

import importlib.util
import signal

import fake_peers
import pytest
import torch

from llmstep.core.config import LlamaConfig
from llmstep.lab import peer_engines, peers
from llmstep.lab.hardware import random_model
from llmstep.lab.peer_process import PeerFailed, PeerProcess, describe_exit


def tiny():
    config = LlamaConfig.preset("llama-3.2-1b", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden_dim=128,
                                vocab_size=256, max_seq_len=64, bos_token_id=None, eos_token_id=[])
    return random_model(config, "cpu", torch.float32, 0)


def test_an_exit_code_is_named_as_the_signal_or_status_it_was():
    assert describe_exit(-signal.SIGILL) == "killed by signal SIGILL (Illegal instruction)"
    assert describe_exit(-signal.SIGSEGV).startswith("killed by signal SIGSEGV")
    assert describe_exit(3) == "exited with status 3"
    assert describe_exit(None) == "stopped answering"


def test_a_child_that_hangs_is_stopped_after_the_answer_time_not_waited_on_for_ever(monkeypatch):
    from llmstep.lab import peer_process

    child = PeerProcess(fake_peers.hangs_in_runs, peer_engines.PeerSpec("fake", "float32", 1, 16))
    monkeypatch.setattr(peer_process, "ANSWER_SECONDS", 1)
    try:
        with pytest.raises(PeerFailed, match=r"^gave no answer in 1 s while repeat 1: stopped$"):
            child.run([1, 2], 3, "repeat 1")
        assert not child.process.is_alive()
    finally:
        child.close()


def test_a_child_that_dies_is_peer_failed_naming_the_signal_and_when():
    child = PeerProcess(fake_peers.dies_of_sigill, peer_engines.PeerSpec("fake", "float32", 1, 16))
    try:
        assert child.run([1, 2], 3, "warming up") == (0.001, 0.001, [0, 0, 0])
        with pytest.raises(PeerFailed, match=r"^killed by signal SIGILL \(Illegal instruction\) while repeat 1$"):
            child.run([1, 2], 3, "repeat 1")
        assert child.process.exitcode == -signal.SIGILL
    finally:
        child.close()


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_a_peer_killed_by_a_signal_and_peers_that_raise_are_recorded_and_the_other_rows_still_come(monkeypatch):
    for name, make in (("sigill", fake_peers.dies_of_sigill), ("raises", fake_peers.raises_at_start),
                       ("raises-in-runs", fake_peers.raises_in_runs)):
        monkeypatch.setitem(peers.MAKERS, name, make)
    model = tiny()
    record = peers.run_peers(model, ["sigill", "transformers", "raises", "raises-in-runs"], ["float32"],
                             prompt_len=6, new_tokens=16, repeats=2, compile=False, bandwidth=False,
                             log=lambda m: None)  # transformers' 15 steps measurable beside its prefill under load
    failed = {f["peer"]: f["why"] for f in record["failed"]}
    assert failed == {"sigill": "killed by signal SIGILL (Illegal instruction) while repeat 1",
                      "raises": "ValueError: fake peer refuses float32 (raised while starting)",
                      "raises-in-runs": "RuntimeError: fake peer's run failed (raised while warming up)"}
    assert [r["engine"] for r in record["rows"]] == ["llmstep FastDecoder", "transformers generate()"]
    hf = record["rows"][1]
    assert hf["same_tokens_as_llmstep"] == 16 and len(hf["decode_tokens_per_s"]["all_runs"]) == 2
    # transformers' process loaded its own copy: llmstep's tensors were not moved into shared memory to reach it
    assert not any(t.is_shared() for t in model.state_dict().values())
    table = peers.format_peers(record)
    assert "sigill FAILED at float32" in table and "SIGILL" in table and "transformers generate()" in table


def test_amx_is_read_from_the_cpu_flags_and_turns_llama_cpps_extra_buffer_types_off(monkeypatch):
    assert peer_engines.cpu_has_amx("processor : 0\nflags : fpu avx512f amx_bf16 amx_tile amx_int8\n")
    assert not peer_engines.cpu_has_amx("processor : 0\nflags : fpu avx2 avx512f avx512_bf16\n")
    monkeypatch.setattr(peers, "cpu_has_amx", lambda: True)
    on, why = peers._extra_bufts(None)
    assert on is False and why.startswith("off: this CPU has AMX")
    monkeypatch.setattr(peers, "cpu_has_amx", lambda: False)
    assert peers._extra_bufts(None)[0] is True and peers._extra_bufts(False) == (False, "off (asked)")


def test_a_peer_whose_process_cannot_start_is_peer_failed():
    with pytest.raises(PeerFailed, match="its process could not start: .*pickle"):
        PeerProcess(lambda spec: None, peer_engines.PeerSpec("fake", "float32", 1, 16))  # a lambda cannot travel
