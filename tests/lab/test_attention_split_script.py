"""scripts/attention_split.py (kernels/cpu_attention.py's CHUNK): a small run writes its record, every split timed
at every thread count, torch's threads left as found; a bad split is named before anything is built."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import import_script

from llmstep.kernels import cpu_attention


def test_a_small_run_writes_its_record_and_leaves_the_threads(tmp_path):
    if not cpu_attention.install():
        pytest.skip(f"the kernel did not build here: {cpu_attention.why()}")
    script, out, threads = import_script("attention_split.py"), tmp_path / "split.json", torch.get_num_threads()
    script.main(["--slots", "64", "--seen", "50", "--caches", "3", "--rounds", "2", "--threads", "1", "2",
                 "--splits", "0:1", "16:4", "--out", str(out)])
    assert torch.get_num_threads() == threads
    record = json.loads(out.read_text())
    assert [(c["threads"], c["chunk"], c["most"]) for c in record["calls"]] == [(1, 0, 1), (1, 16, 4), (2, 0, 1),
                                                                               (2, 16, 4)]
    assert all(len(c["rounds_us"]) == 2 and c["best_us"] <= c["median_us"] for c in record["calls"])
    assert (record["slots"], record["seen"], record["caches"], record["isa"]) == (64, 50, 3, cpu_attention.isa_here())
    assert record["command"].startswith("python scripts/attention_split.py --slots 64")


@pytest.mark.parametrize("argv, message", [
    (["--splits", "128:0"], "a split is CHUNK:MOST (0:1 whole, 128:8 llmstep's), got '128:0'"),
    (["--seen", "300"], "--seen must be 1..--slots (256), got 300"),
    (["--head-dim", "24"], "--head-dim must be a multiple of 16, got 24"),
    (["--threads", "2", "0"], "--threads must be at least 1, got 0")])
def test_a_bad_argument_is_named_before_anything_is_allocated(capsys, monkeypatch, argv, message):
    script = import_script("attention_split.py")
    monkeypatch.setattr(script.torch, "randn", lambda *a, **k: pytest.fail("allocated before the check"))
    monkeypatch.setattr(script.cpu_attention, "build", lambda *a, **k: pytest.fail("built before the check"))
    with pytest.raises(SystemExit):
        script.main(argv)
    err = capsys.readouterr().err
    assert message in err and err.count("must") + err.count("a split is") == 1  # that one, not the others
