"""A GGUF file's tokenizer (`tokenizer.ggml.*`) rebuilt as a `tokenizers` tokenizer that gives llama.cpp's ids.

llama.cpp stores a byte-level BPE (`tokenizer.ggml.model = "gpt2"`) as its pieces: every token's text and type
(normal, control, user-defined, unused), the merges as "left right" strings in rank order, and the name of the
rule that splits text into words before BPE runs (`tokenizer.ggml.pre`). llama.cpp keeps one regex list per name
(src/llama-vocab.cpp); the names read here, and the `tokenizers` pre-tokenizer that splits the same way:

    llama-bpe (llama3, llama-v3)  Llama 3's split regex, and a word that is itself a token is taken whole
                                  (llama.cpp's ignore_merges, the same flag in `tokenizers`)
    smollm                        every digit alone (\\p{N}), then GPT-2's regex
    gpt-2                         GPT-2's regex (the one ByteLevel applies)

Any other model or pre-tokenizer is refused by name: a tokenizer that splits text differently from llama.cpp
would give other ids for the same prompt, and the model would read text it was never trained on.

A user-defined token decodes to its own text, as in llama.cpp (the tokenizer's `literal_ids`), and an unused one to
nothing. The unused ones that pad the vocabulary past the tokenizer's (the `[PAD<id>]` tokens at its end, which
llama.cpp's converter and export_gguf write) are left out, so their ids are the model's padding, as before export;
any other stays in the vocabulary (llama.cpp's BPE still makes it where its merges lead) among the tokenizer's
`unused_ids`.
"""

from __future__ import annotations

import json

import tokenizers

from .chat import check_template
from .tokens import Tokenizer

__all__ = ["PRE_TOKENIZERS", "GGUFVocabError", "EOG_TEXTS", "build_tokenizer", "pre_tokenizer_spec"]

# Llama 3's pre-tokenizer split (meta-llama/Llama-3.1-8B tokenizer.json); llama.cpp's "llama-bpe" uses the same.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
_LLAMA3 = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
    _BYTE_LEVEL | {"use_regex": False}]}
_SMOLLM = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": r"\p{N}"}, "behavior": "Isolated", "invert": False},
    _BYTE_LEVEL | {"use_regex": True}]}
_GPT2 = _BYTE_LEVEL | {"use_regex": True}
# tokenizer.ggml.pre -> (the pre-tokenizer, ignore_merges): llama.cpp's names for the same rule are aliases.
PRE_TOKENIZERS = {"llama-bpe": (_LLAMA3, True), "llama3": (_LLAMA3, True), "llama-v3": (_LLAMA3, True),
                  "smollm": (_SMOLLM, False), "gpt-2": (_GPT2, False)}
ADDS_BOS = {"llama-bpe", "llama3", "llama-v3"}  # llama.cpp starts their text with bos unless add_bos_token says no
# gguf.TokenType values
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
# How llama.cpp's vocabulary loader (src/llama-vocab.cpp, as llama-cpp-python 0.3.36 builds it) finds the ids that end
# generation, by the tokens' text: a token spelled as one of EOG_TEXTS is a control token, whatever the file typed it
# (user-defined, normal: every token of a file without token types, or unused), and an end.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>")
# So is each token found by its text for a kind the file names no id for (tokenizer.ggml.<kind>_token_id): a token
# spelled as one of the kind's texts (the first llama.cpp's hash map lists; here the lowest id) becomes a control
# token, and the end-of-turn one and the fill-in-the-middle pad, repository and file-separator ones end generation
# too (SmolLM2's `<reponame>`, id 4, does). The end-of-turn spellings are ends anyway, but for DeepSeek's.
BY_TEXT = {"eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
                   "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
           "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                       "<|code_prefix|>", "<|prefix|>"),
           "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                       "<|code_suffix|>", "<|suffix|>"),
           "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                       "<|code_middle|>", "<|middle|>"),
           "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
           "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
           "fim_sep": ("<|file_sep|>",)}
ENDS_BY_TEXT = ("eot", "fim_pad", "fim_rep", "fim_sep")


class GGUFVocabError(ValueError):
    """A GGUF tokenizer llmstep cannot rebuild exactly; the message names the field."""


def pre_tokenizer_spec(pre: str, where: str) -> tuple[dict, bool]:
    """tokenizer.ggml.pre -> (the `tokenizers` pre-tokenizer that splits text as llama.cpp does, ignore_merges)."""
    if pre not in PRE_TOKENIZERS:
        raise GGUFVocabError(f"{where}: tokenizer.ggml.pre is {pre!r}, a split rule llmstep does not rebuild "
                             f"(it reads {', '.join(PRE_TOKENIZERS)}); its ids would differ from llama.cpp's")
    return PRE_TOKENIZERS[pre]


def _split_merge(merge: str, i: int, where: str) -> list[str]:
    """"left right" -> [left, right], split at the first space after the first character (as llama.cpp does)."""
    cut = merge.find(" ", 1)
    if cut < 0:
        raise GGUFVocabError(f"{where}: tokenizer.ggml.merges[{i}] = {merge!r} is not two pieces joined by a space")
    return [merge[:cut], merge[cut + 1:]]


def build_tokenizer(fields: dict, where: str) -> Tokenizer:
    """The tokenizer.ggml.* values (`fields`: key -> value, as the gguf reader returns them) -> a Tokenizer whose
    ids equal llama.cpp's, with the file's bos/eos ids, add_bos and chat template."""
    model = fields.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFVocabError(f"{where}: tokenizer.ggml.model is {model!r}; llmstep reads byte-level BPE ('gpt2', "
                             "Llama 3's kind) only, not SentencePiece ('llama') or others")
    pre_name = fields.get("tokenizer.ggml.pre", "default")
    pre, ignore_merges = pre_tokenizer_spec(pre_name, where)
    tokens, types = fields.get("tokenizer.ggml.tokens"), fields.get("tokenizer.ggml.token_type")
    merges = fields.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise GGUFVocabError(f"{where}: tokenizer.ggml.tokens must be a non-empty list of strings")
    if types is None:
        types = [NORMAL] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens):
        raise GGUFVocabError(f"{where}: tokenizer.ggml.token_type must give one type per token ({len(tokens)})")
    if merges is None:
        raise GGUFVocabError(f"{where}: tokenizer.ggml.merges is missing; a byte-level BPE needs its merges")
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise GGUFVocabError(f"{where}: tokenizer.ggml.merges must be a list of strings")
    # a token spelled as an end (EOG_TEXTS), or as a token of a kind the file names no id for (BY_TEXT), is a
    # control token, as llama.cpp reads it
    found = {}  # kind -> the id found by its text
    for kind, texts in BY_TEXT.items():
        if fields.get(f"tokenizer.ggml.{kind}_token_id") is None:
            found[kind] = next((i for i, text in enumerate(tokens) if text in texts), None)
    types = [CONTROL if text in EOG_TEXTS or i in found.values() else kind
             for i, (text, kind) in enumerate(zip(tokens, types, strict=True))]
    unknown = sorted({t for t in types if t not in (NORMAL, CONTROL, USER_DEFINED, UNUSED)})
    if unknown:
        raise GGUFVocabError(f"{where}: token type {unknown[0]} (tokenizer.ggml.token_type) is not one a byte-level "
                             "BPE uses (normal 1, control 3, user-defined 4, unused 5)")
    n = n_file = len(tokens)
    while n and types[n - 1] == UNUSED and tokens[n - 1] == f"[PAD{n - 1}]":  # padding: no text, no merge makes it
        n -= 1
    tokens, types = tokens[:n], types[:n]

    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        if text in vocab:
            raise GGUFVocabError(f"{where}: token {text!r} appears twice (ids {vocab[text]} and {i})")
        vocab[text] = i
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind == CONTROL}
             for i, kind in enumerate(types) if kind in (CONTROL, USER_DEFINED)]
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": pre, "post_processor": None,  # set below where text starts with bos
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": ignore_merges, "vocab": vocab,
                  "merges": [_split_merge(m, i, where) for i, m in enumerate(merges)]},
    }
    try:
        tok = tokenizers.Tokenizer.from_str(json.dumps(spec))
    except Exception as e:  # tokenizers raises a bare Exception on a spec it cannot build
        raise GGUFVocabError(f"{where}: the tokenizer cannot be rebuilt: {e}") from None

    def token_id(key: str) -> int | None:
        value = fields.get(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if isinstance(value, int) and len(tokens) <= value < n_file:
            raise GGUFVocabError(f"{where}: tokenizer.ggml.{key} = {value} names [PAD{value}], one of the tokens that "
                                 f"pad the vocabulary past the tokenizer's {len(tokens)}")
        if not isinstance(value, int) or not 0 <= value < len(tokens):
            raise GGUFVocabError(f"{where}: tokenizer.ggml.{key} = {value!r} is not a token id (0..{len(tokens) - 1})")
        return value

    bos = token_id("bos_token_id")
    add_bos = fields.get("tokenizer.ggml.add_bos_token", pre_name in ADDS_BOS and bos is not None)
    if not isinstance(add_bos, bool):
        raise GGUFVocabError(f"{where}: tokenizer.ggml.add_bos_token must be true or false, got {add_bos!r}")
    if add_bos and bos is None:
        raise GGUFVocabError(f"{where}: tokenizer.ggml.add_bos_token is set but there is no bos_token_id")
    if add_bos:  # in tokenizer.json too, so that transformers' tokenizer of a saved checkpoint starts with bos
        spec["post_processor"] = {"type": "TemplateProcessing", "special_tokens": {
            tokens[bos]: {"id": tokens[bos], "ids": [bos], "tokens": [tokens[bos]]}},
            "single": [{"SpecialToken": {"id": tokens[bos], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": tokens[bos], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}]}
        tok = tokenizers.Tokenizer.from_str(json.dumps(spec))
    add_eos = fields.get("tokenizer.ggml.add_eos_token", False)
    if add_eos is not False:  # llama.cpp would end every encoded text with eos; a prompt that ends so is no prompt
        raise GGUFVocabError(f"{where}: tokenizer.ggml.add_eos_token is {add_eos!r}; llmstep encodes text as a "
                             "decoder's prompt, with no end token appended (a file for generation has it false or "
                             "absent)")
    ends = [token_id(k) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    ends += [i for i, kind in enumerate(types) if kind == CONTROL and tokens[i] in EOG_TEXTS]
    ends += [found[kind] if kind in found else token_id(f"{kind}_token_id") for kind in ENDS_BY_TEXT]
    ends = [i for i in ends if i is not None]
    texts = {tokens[i] for i in ends}  # and llama.cpp's exceptions, for vocabularies where these end a message only:
    if "<|end|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts) and texts & {"<|return|>", "<|flush|>"}:
        ends = [i for i in ends if tokens[i] != "<|end|>"]  # gpt-oss's and Solar Open's
    if "<|tool_response>" in texts:
        ends = [i for i in ends if tokens[i] != "</s>"]  # Gemma 4's
    template = fields.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise GGUFVocabError(f"{where}: tokenizer.chat_template must be a string")
    if template is not None:  # a broken template is refused now, not after the weights load at the first chat
        try:
            check_template(template)
        except ValueError as e:
            raise GGUFVocabError(f"{where}: tokenizer.chat_template: {e}") from None
    return Tokenizer(tok, bos_id=bos, eos_ids=ends, add_bos=add_bos,
                     chat_template=template, unused_ids=[i for i, kind in enumerate(types) if kind == UNUSED],
                     literal_ids=[i for i, kind in enumerate(types) if kind == USER_DEFINED])
