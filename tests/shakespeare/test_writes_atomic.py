"""The Shakespeare tools' files (corpus, manifest, checksums, model card, eval.json, golden.json) are written
atomically: a write interrupted at its final rename leaves the old file whole and no temporary file behind."""

import os

import pytest

from llmstep.shakespeare import data, evaluate


class Boom(Exception):
    pass


@pytest.fixture
def failing_rename(monkeypatch):
    def fail(*args, **kwargs):
        raise Boom("interrupted")

    return lambda: monkeypatch.setattr(os, "replace", fail)


def _only(path, *names):
    return sorted(p.name for p in path.iterdir()) == sorted(names)


def test_checksums_and_gzip_files(tmp_path, failing_rename):
    (tmp_path / "a.txt").write_text("a")
    out = tmp_path / "checksums.txt"
    out.write_text("old\n")
    gz = tmp_path / "train.txt.gz"
    gz.write_bytes(b"old")
    failing_rename()
    with pytest.raises(Boom):
        data.write_checksums(tmp_path, out)
    with pytest.raises(Boom):
        data.write_gzip(gz, b"new text")
    assert out.read_text() == "old\n" and gz.read_bytes() == b"old"
    assert _only(tmp_path, "a.txt", "checksums.txt", "train.txt.gz")


def test_model_card_update(tmp_path, failing_rename):
    card = tmp_path / "README.md"
    card.write_text(f"# m\n\n## Evaluation\n\n{evaluate.CARD_START}\nold\n{evaluate.CARD_END}\n")
    before = card.read_text()
    failing_rename()
    with pytest.raises(Boom):
        evaluate.update_card(tmp_path, "| new |", "note")
    assert card.read_text() == before and _only(tmp_path, "README.md")


def test_eval_and_golden_json(tmp_path, monkeypatch, failing_rename):
    for name in ("eval.json", "golden.json"):
        (tmp_path / name).write_text("{}\n")
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(evaluate, "evaluate_model", lambda *a, **k: evaluate.Score("m", "val", 10, 20, 5.0))
    monkeypatch.setattr(evaluate, "golden", lambda *a, **k: {"text": "new"})
    monkeypatch.setattr(evaluate.LlamaConfig, "from_hf", lambda *a: type("C", (), {"max_seq_len": 8}))
    failing_rename()
    for kwargs in ({"write_eval_json": True}, {"golden_prompt": "ROMEO:"}):
        with pytest.raises(Boom):
            evaluate.evaluate_models([tmp_path], splits=("val",), baseline=False, **kwargs)
    assert (tmp_path / "eval.json").read_text() == (tmp_path / "golden.json").read_text() == "{}\n"
    assert _only(tmp_path, "config.json", "eval.json", "golden.json")
