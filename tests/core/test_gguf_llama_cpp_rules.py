"""The rules llama.cpp's vocabulary loader applies to a GGUF file beyond its fields (src/llama-vocab.cpp, as
llama-cpp-python 0.3.36 builds it), which llmstep.core.gguf_vocab follows: which ids end generation (by the tokens'
text: end-of-turn spellings, fill-in-the-middle tokens, two exceptions), user-defined tokens decoded as their own
text; and the GGUF readers' refusals that name what is wrong. Each expectation here was read off llama-cpp-python's
`llama_vocab_is_eog` / `detokenize` on files built the same way (scratch runs, session 50)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llmstep.core.gguf_rope import llama31_scaling_of
from llmstep.core.rope import inv_frequencies

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")

from llmstep.core.gguf import gguf_vocab  # noqa: E402  (needs the gguf package)
from llmstep.core.gguf_load import GGUFLoadError, read_gguf  # noqa: E402
from llmstep.core.gguf_vocab import CONTROL, NORMAL, UNUSED, USER_DEFINED, GGUFVocabError, build_tokenizer  # noqa: E402
from llmstep.core.tokens import Tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def vocab(tokenizer_file) -> dict:
    """The shipped tokenizer's tokenizer.ggml.* values, its vocabulary padded to 320 with [PAD<id>] (unused)."""
    return gguf_vocab(Tokenizer.from_file(tokenizer_file), 320)


def with_tokens(vocab: dict, placed: dict[str, int], **fields) -> Tokenizer:
    """The vocabulary with each text of `placed` written over a padding token, typed as given -> its tokenizer."""
    tokens, types = list(vocab["tokens"]), list(vocab["types"])
    slots = iter(range(300, 320))  # padding ids, before the last: the padding stripped from the end stays padding
    for text, kind in placed.items():
        slot = next(slots)
        tokens[slot], types[slot] = text, kind
    return build_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": vocab["pre"],
                            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                            "tokenizer.ggml.merges": vocab["merges"]} | fields, "x.gguf")


def ends(tok: Tokenizer) -> set[str]:
    return {tok.id_to_token(i) for i in tok.eos_ids}


@pytest.mark.parametrize("text", ["<|fim_pad|>", "<fim_pad>", "[PAD]", "<|repo_name|>", "<reponame>", "<REPO>",
                                  "<|file_sep|>"])
def test_fill_in_the_middle_pad_repository_and_separator_tokens_end_generation_as_in_llama_cpp(vocab, text):
    """SmolLM2's GGUF has `<reponame>` (id 4): llama.cpp stops there, so does llmstep; typed normal, it is made a
    control token (one token, not its pieces)."""
    tok = with_tokens(vocab, {text: NORMAL})
    assert text in ends(tok) and text in tok.special_tokens
    assert tok.encode(f"a{text}", bos=False)[-1] == tok.token_to_id(text)


@pytest.mark.parametrize("text", ["<|fim_prefix|>", "<fim-suffix>", "<MID>", "<｜fim▁begin｜>"])
def test_fill_in_the_middle_prefix_suffix_and_middle_tokens_are_control_tokens_but_no_end(vocab, text):
    tok = with_tokens(vocab, {text: USER_DEFINED})
    assert text not in ends(tok) and text in tok.special_tokens


def test_a_fill_in_the_middle_id_the_file_names_ends_generation_instead_of_the_one_its_text_would_find(vocab):
    named = 200  # an ordinary token of the vocabulary
    tok = with_tokens(vocab, {"<reponame>": NORMAL}, **{"tokenizer.ggml.fim_rep_token_id": named})
    assert named in tok.eos_ids
    assert "<reponame>" not in ends(tok) and "<reponame>" not in tok.special_tokens
    with pytest.raises(GGUFVocabError, match="fim_rep_token_id = 400 is not a token id"):
        with_tokens(vocab, {}, **{"tokenizer.ggml.fim_rep_token_id": 400})


def test_deepseeks_end_of_sentence_ends_a_turn_where_the_file_names_no_end_of_turn_id(vocab):
    """llama.cpp guesses the end-of-turn token by its text when tokenizer.ggml.eot_token_id is absent; of its
    spellings only DeepSeek's is not an end by itself."""
    text = "<｜end▁of▁sentence｜>"
    own = {"<|eot_id|>": "<|x_eot|>", "<|end_of_text|>": "<|x_end|>"}  # the shipped ends, spelled as no end
    vocab = vocab | {"tokens": [own.get(t, t) for t in vocab["tokens"]]}
    assert ends(with_tokens(vocab, {})) == set() and ends(with_tokens(vocab, {text: NORMAL})) == {text}
    named = with_tokens(vocab, {text: NORMAL}, **{"tokenizer.ggml.eot_token_id": 200})
    assert text not in ends(named) and named.eos_ids == [200]


@pytest.mark.parametrize("texts, gone", [
    (("<|end|>", "<|return|>", "<|call|>"), "<|end|>"),  # gpt-oss: <|end|> ends a message, not the reply
    (("<|end|>", "<|calls|>", "<|flush|>"), "<|end|>"),  # Solar Open
    (("</s>", "<|tool_response>"), "</s>"),  # Gemma 4
])
def test_llama_cpps_two_exceptions_take_an_end_back_out(vocab, texts, gone):
    own = ends(with_tokens(vocab, {}))  # the shipped vocabulary's <|eot_id|> and <|end_of_text|>
    assert ends(with_tokens(vocab, dict.fromkeys(texts, CONTROL))) - own == set(texts) - {gone}
    assert ends(with_tokens(vocab, {gone: UNUSED})) - own == {gone}  # typed unused, still an end: its text decides


def test_a_user_defined_token_decodes_to_its_own_text_as_llama_cpp_writes_it(vocab):
    """The byte-level decoder would read é (a byte symbol of GPT-2's alphabet) in "café" as a byte: 'caf\ufffd'."""
    texts = ["café", "über", "<ĠxĠ>", "東京"]
    tok = with_tokens(vocab, dict.fromkeys(texts, USER_DEFINED))
    for text in texts:
        ids = tok.encode(f"un {text} x", bos=False)
        assert tok.token_to_id(text) in ids
        stream = tok.stream()
        assert tok.decode(ids) == "".join(map(stream.step, ids)) + stream.flush() == f"un {text} x"
        assert tok.decode(ids, skip_special_tokens=True) == f"un {text} x"  # user-defined: not special
    cafe, tokyo = tok.token_to_id("café"), tok.token_to_id("東京")
    assert tok.decode([cafe, cafe, tokyo]) == "cafécafé東京"


def test_a_saved_gguf_tokenizer_decodes_as_it_did(vocab, tmp_path):
    """save_dir writes which ids decode to their own text and which to nothing (tokenizer_config.json's
    llmstep_literal_ids / llmstep_unused_ids), so the folder's tokenizer decodes as the file's did; transformers
    reads the folder too."""
    import transformers

    tok = with_tokens(vocab, {"café": USER_DEFINED, "[unused]": UNUSED})
    ids = tok.encode("un café", bos=False) + [tok.token_to_id("[unused]")]
    tok.save_dir(tmp_path)
    back = Tokenizer.from_dir(tmp_path)
    assert (back.literal_ids, back.unused_ids) == (tok.literal_ids, tok.unused_ids) != (frozenset(), frozenset())
    assert back.decode(ids) == tok.decode(ids) == "un café"
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).encode("un café", add_special_tokens=False) == ids[:-1]


def test_an_end_id_on_the_vocabularys_padding_is_refused_by_name(vocab):
    with pytest.raises(GGUFVocabError, match=r"eos_token_id = 310 names \[PAD310\], one of the tokens that pad"):
        with_tokens(vocab, {}, **{"tokenizer.ggml.eos_token_id": 310})


def test_a_file_without_merges_is_told_they_are_missing(vocab):
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": vocab["pre"],
              "tokenizer.ggml.tokens": vocab["tokens"]}
    with pytest.raises(GGUFVocabError, match="tokenizer.ggml.merges is missing"):
        build_tokenizer(fields, "x.gguf")


def test_a_quantized_tensor_whose_rows_are_not_whole_blocks_is_refused_as_such(tmp_path):
    path = tmp_path / "rows.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    raw = np.zeros(64 * 128 // 256 * 144, np.int8)  # Q4_K: 144 bytes a block of 256; the rows hold 128
    w.add_tensor("blk.0.attn_q.weight", raw, raw_shape=(64, 128), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFLoadError, match="a quantized tensor's rows are not whole blocks of its type") as e:
        read_gguf(path)
    assert "truncated" not in str(e.value)


def llama3_factors(head_dim: int, theta: float, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """rope_freqs as llama.cpp's converter writes them from a config.json's rope_scaling (one factor per pair)."""
    out = []
    for f in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            s = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, np.float32)


@pytest.mark.parametrize("low, high, orig", [(3.0, 8.0, 1000), (1.0, 4.0, 8192), (2.0, 8.0, 512)])
def test_rope_freqs_of_any_whole_low_freq_factor_read_back_as_a_scaling_that_gives_them(low, high, orig):
    """A low_freq_factor of 3 with an original context of 1000 is (333.3..., 1, 2.67) at low 1: no whole
    original_max_position_embeddings, so it was refused as not Llama 3.1's rule; llama.cpp runs the file."""
    f = llama3_factors(64, 10000.0, 8.0, low, high, orig)
    got = llama31_scaling_of(f, 64, 10000.0)
    plain = inv_frequencies(64, 10000.0).double().numpy()
    assert np.allclose(plain / inv_frequencies(64, 10000.0, got).double().numpy(), f, rtol=1e-6)
    assert got.original_max_position_embeddings * low == pytest.approx(orig * got.low_freq_factor)
    if low == 1.0:  # a file of Llama 3.1's own kind keeps its parameters
        assert (got.low_freq_factor, got.high_freq_factor, got.original_max_position_embeddings) == (low, high, orig)
