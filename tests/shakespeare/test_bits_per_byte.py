"""Bits per byte counts the UTF-8 bytes of the text the predicted tokens stand for, whatever the tokenizer: a byte-level
BPE's tokens are bytes (the shipped tokenizer's counts, recorded in data/models/eval.json, stay what they were); a
Metaspace/byte-fallback one (Llama 2's kind) spells "\\n" as "<0x0A>", a space as "▁", and "é" as one character."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers

from llmstep.shakespeare import data, evaluate

RECORDED = data.CORPUS_DIR.parent / "models"


def byte_fallback_tokenizer() -> Tokenizer:
    """A Llama-2-style tokenizer: "▁" for a space (one prepended to each document), "<0xNN>" for a byte not in the
    vocabulary, a decoder that turns both back and drops the document's first space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", "R", "O", "M", "E", ":", "é", "c", "a", "f", "▁H", "o", "!"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def test_a_byte_fallback_tokenizers_bytes_are_those_of_the_text_it_stands_for():
    tok = byte_fallback_tokenizer()
    works = ["ROMEO:\n\ncafé", "Ho ü!"]  # "\n" and "ü" by byte fallback, "é" a token of two bytes
    ids = [1]
    for text in works:
        ids += [*tok.encode(text, add_special_tokens=False).ids, 2, 1]
    assert "<0x0A>" in [tok.id_to_token(i) for i in ids] and "<0xC3>" in [tok.id_to_token(i) for i in ids]
    assert evaluate.count_bytes(tok, ids) == sum(len(text.encode()) for text in works) == 19


def test_a_tokenizer_without_a_decoder_counts_each_tokens_utf8():
    tok = byte_fallback_tokenizer()
    tok.decoder = None
    ids = [1, *tok.encode("café", add_special_tokens=False).ids, 2]  # "▁", "c", "a", "f", "é"
    assert evaluate.count_bytes(tok, ids) == len("▁café".encode())


@pytest.mark.parametrize("split", ["val", "test"])
def test_the_shipped_tokenizers_counts_are_those_recorded(split):
    tok = evaluate.load_tokenizer(data.TOKENIZER_PATH)
    whole = {s["split"]: s["bytes"] for s in json.loads((RECORDED / "eval.json").read_text())["scores"]}
    assert evaluate.count_bytes(tok, evaluate.split_ids(tok, split)) == whole[split]
    sliced = json.loads((RECORDED / "shakespeare-target" / "eval.json").read_text())
    if sliced["scores"][0]["split"] == split:
        ids = evaluate.split_ids(tok, split, max_tokens=sliced["settings"]["max_tokens"])
        assert evaluate.count_bytes(tok, ids) == sliced["scores"][0]["bytes"]
