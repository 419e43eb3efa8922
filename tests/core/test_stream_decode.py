"""The stream decoder: pieces that are final text, adding up to decode(ids), for byte-level and byte-fallback
tokenizers alike."""

import random

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers
from tokenizers.decoders import DecodeStream

from llmstep.core.checkpoint import DATA_DIR
from llmstep.core.tokens import Tokenizer


def byte_fallback_tokenizer() -> Tokenizer:
    """A Llama 2 / Mistral-style tokenizer: Metaspace pieces, <0xNN> byte tokens, a Strip decoder."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", "a", "b", "▁a", "▁b", "ab", "▁ab", "é", "東", "京", "▁東"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b"), ("▁", "東")]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>",
                                          fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer(tok, bos_id=1, eos_ids=[2], add_bos=True)


def pieces(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    d = tok.stream(skip)
    return [d.step(i) for i in ids] + [d.flush()]


def test_a_run_of_byte_tokens_is_shown_only_when_it_ends():
    tok = byte_fallback_tokenizer()
    byte = {b: 3 + b for b in range(256)}
    word = tok.token_to_id("▁ab")
    # an emoji's four bytes, then a stray lead byte: decode shows the whole run as U+FFFD (tokenizers raised here)
    ids = [byte[0xF0], byte[0x9F], byte[0x99], byte[0x82], byte[0xF0], word]
    got = pieces(tok, ids, True)
    assert got[:5] == [""] * 5 and "".join(got) == tok.decode(ids, True) == "\ufffd" * 5 + " ab"
    # "A" alone is a whole character, but a lead byte after it makes the run invalid: "A" is never shown
    assert pieces(tok, [byte[0x41], byte[0xE6]], True) == ["", "", "\ufffd\ufffd"]
    # a skipped special between byte tokens leaves them one run, as decode sees them
    ids = [byte[0x41], tok.token_to_id("</s>"), byte[0xE6], word]
    assert "".join(pieces(tok, ids, True)) == tok.decode(ids, True)


@pytest.mark.parametrize("skip", [False, True])
def test_byte_fallback_pieces_are_final_and_add_up_to_decode(skip):
    tok, rng = byte_fallback_tokenizer(), random.Random(0)
    for _ in range(1500):
        ids = [rng.randrange(tok.vocab_size) if rng.random() < 0.5 else rng.randrange(3, 259)
               for _ in range(rng.randint(1, 12))]
        got, full = pieces(tok, ids, skip), tok.decode(ids, skip)
        assert "".join(got) == full, ids
        shown = ""
        for piece in got[:-1]:  # nothing shown is taken back
            shown += piece
            assert full.startswith(shown), ids


@pytest.mark.parametrize("skip", [False, True])
def test_byte_level_pieces_are_tokenizers_own_stream(skip):
    """On a byte-level BPE (the shipped tokenizer, Llama 3's kind) every piece is DecodeStream's."""
    tok, rng = Tokenizer.from_file(DATA_DIR / "tokenizer.json"), random.Random(1)
    seqs = [tok.encode("héllo 東京 🙂👍🏽 👨‍👩‍👧 a\u0301", bos=False)]
    seqs += [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(500)]
    for ids in seqs:
        stream = DecodeStream(skip_special_tokens=skip)
        got = pieces(tok, ids, skip)
        assert got[:-1] == [stream.step(tok.tok, i) or "" for i in ids] and "".join(got) == tok.decode(ids, skip)
