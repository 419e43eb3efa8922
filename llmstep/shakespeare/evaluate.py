"""How good is a model? Held-out perplexity and bits per byte, next to an n-gram baseline.

    llmstep eval                                   # both shipped models, val and test plays
    llmstep eval data/models/shakespeare-target --split test --json results.json

Every split is scored as the models were trained: each held-out work is one stream
`<|begin_of_text|> text <|end_of_text|>` (see `llmstep.shakespeare.data.encode_split`), cut into non-overlapping
windows of `seq_len + 1` tokens. Inside a window, token t is predicted from tokens 0..t-1 of the same
window; every token but the very first <|begin_of_text|> is predicted exactly once.

- perplexity = exp(mean negative log-likelihood per predicted token), in nats: lower is better; a
  uniform guess over 8192 tokens scores 8192.
- bits per byte = total NLL / ln 2 / UTF-8 bytes of the predicted text: independent of the tokenizer,
  so it compares models with different vocabularies (and with gzip -9: 3.14 bits per byte on train, 3.12 on
  val, 3.29 on test, from data/corpus/manifest.json's sizes).

The baseline is an interpolated Kneser-Ney trigram model over the same BPE tokens, fitted on the train
split and scored on the same windows (so it, too, sees no context across a window boundary).
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import decoders

from ..core.checkpoint import SHIPPED, load, load_model, resolve_model_path
from ..core.config import LlamaConfig
from ..core.files import atomic_write_json, atomic_write_text, check_output_path
from ..core.tokens import Tokenizer
from ..engines.generate import generate
from . import data

CARD_START, CARD_END = "<!-- eval:start -->", "<!-- eval:end -->"


@dataclass
class Score:
    """One model (or the baseline) on one split."""

    name: str
    split: str
    tokens: int  # predicted tokens
    bytes: int  # UTF-8 bytes those tokens spell (special tokens count 0)
    nll_nats: float  # summed negative log-likelihood

    @property
    def loss(self) -> float:
        """Mean NLL per token, nats (the training loss)."""
        return self.nll_nats / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> float:
        return self.nll_nats / math.log(2) / self.bytes

    def to_dict(self) -> dict:
        derived = {"loss": self.loss, "perplexity": self.perplexity, "bits_per_byte": self.bits_per_byte}
        return asdict(self) | derived


# --------------------------------------------------------------------------------------------------
# Token streams and windows
# --------------------------------------------------------------------------------------------------


def split_ids(tokenizer, split: str, corpus=data.CORPUS_DIR, max_tokens: int | None = None) -> list[int]:
    """The split as one token stream, optionally cut to its first max_tokens tokens (a quick slice). A split of
    fewer than 2 tokens (an empty file) is refused, naming its file: it has nothing to predict."""
    ids = data.encode_split(tokenizer, data.read_split(split, corpus))
    if len(ids) < 2:
        raise ValueError(f"{data.split_path(split, corpus)}: the {split} split holds {len(ids)} tokens (an empty "
                         "file?), and needs at least 2: a context token and one to predict")
    if max_tokens is not None:
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be at least 2 (context and a prediction), got {max_tokens}")
        ids = ids[:max_tokens]
    return ids


def windows(ids: list[int], seq_len: int) -> list[list[int]]:
    """Non-overlapping windows of up to seq_len + 1 tokens sharing one token at each boundary.

    Window i is ids[i*seq_len : (i+1)*seq_len + 1]; it predicts its last len - 1 tokens. The last
    window may be shorter. Together they predict ids[1:], each token once.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    return [ids[i : i + seq_len + 1] for i in range(0, len(ids) - 1, seq_len)]


def token_bytes(tokenizer) -> list[int]:
    """UTF-8 bytes each token id stands for in a byte-level BPE: one per character (each character of its tokens
    is one byte, GPT-2's byte-to-character map), 0 for specials."""
    specials = set(tokenizer.get_added_tokens_decoder())
    n = tokenizer.get_vocab_size()
    return [0 if i in specials else len(tokenizer.id_to_token(i)) for i in range(n)]


def count_bytes(tokenizer, ids: list[int]) -> int:
    """UTF-8 bytes of the text the predicted tokens ids[1:] stand for; special tokens stand for none.

    A byte-level BPE (its decoder is ByteLevel, as the shipped tokenizer's) spells bytes: token_bytes counts them. In
    any other tokenizer a token's string is not its bytes (a Metaspace/byte-fallback one, as Llama 2's, spells "\\n"
    as "<0x0A>", "é" as one character, a space as "▁" that its decoder drops at a document's start), so each run of
    ordinary tokens between specials (a document) is decoded and its text counted; with no decoder at all a token is
    its own text."""
    if isinstance(tokenizer.decoder, decoders.ByteLevel):
        table = token_bytes(tokenizer)
        return sum(table[i] for i in ids[1:])
    added = tokenizer.get_added_tokens_decoder()
    specials = {i for i, token in added.items() if token.special}
    if tokenizer.decoder is None:  # decode() would join the tokens with spaces
        return sum(len(tokenizer.id_to_token(i).encode()) for i in ids[1:] if i not in specials)
    runs = itertools.groupby(ids[1:], key=specials.__contains__)
    return sum(len(tokenizer.decode(list(run)).encode()) for special, run in runs if not special)


# --------------------------------------------------------------------------------------------------
# The transformer
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def model_nll(model, ids: list[int], seq_len: int, batch_size: int = 8) -> tuple[float, int]:
    """Summed NLL (nats, float64) and the number of predicted tokens of `ids` under `model`."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    wins = windows(ids, seq_len)
    full = [w for w in wins if len(w) == seq_len + 1]
    rest = [w for w in wins if len(w) != seq_len + 1]  # at most one short window at the end
    groups = [full[i : i + batch_size] for i in range(0, len(full), batch_size)] + [[w] for w in rest]
    for group in groups:
        batch = torch.tensor(group, dtype=torch.long, device=device)  # [B, T+1]
        logits = model(batch[:, :-1]).float()  # [B, T, vocab]
        nll = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total += float(nll.double())
        count += batch[:, 1:].numel()
    model.train(was_training)
    return total, count


# --------------------------------------------------------------------------------------------------
# The baseline: an interpolated Kneser-Ney trigram over BPE tokens
# --------------------------------------------------------------------------------------------------


class KneserNeyTrigram:
    """Interpolated Kneser-Ney (Chen & Goodman 1998, with one absolute discount per order).

    P3(w | u v) = max(c(uvw) - D3, 0) / c(uv.) + D3 * N1+(uv.) / c(uv.) * P2(w | v)
    P2(w | v)   = max(N1+(.vw) - D2, 0) / N1+(.v.) + D2 * N1+(v.) / N1+(.v.) * P1(w)
    P1(w)       = max(N1+(.w) - D1, 0) / N1+(..)  + D1 * N1+(.) / N1+(..) / V
    where c counts occurrences and N1+ counts distinct contexts or continuations; an unseen context
    passes all its mass down. D = n1 / (n1 + 2 n2) from the counts of counts (Ney et al. 1994).
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def fit(self, ids: list[int]) -> KneserNeyTrigram:
        tri = Counter(zip(ids, ids[1:], ids[2:], strict=False))
        bi_types = Counter(zip(ids, ids[1:], strict=False))
        # order 3: counts of trigrams, by their bigram context
        self.c3 = tri
        self.c3_ctx: Counter = Counter()
        self.n3_ctx: Counter = Counter()
        for (u, v, _), c in tri.items():
            self.c3_ctx[u, v] += c
            self.n3_ctx[u, v] += 1
        # order 2: continuation counts N1+(. v w) = distinct u before (v, w)
        self.n2 = Counter((v, w) for (_, v, w) in tri)
        self.n2_ctx: Counter = Counter()  # N1+(. v .)
        self.n2_types: Counter = Counter()  # N1+(v .)
        for (v, _), n in self.n2.items():
            self.n2_ctx[v] += n
            self.n2_types[v] += 1
        # order 1: N1+(. w) = distinct tokens before w
        self.n1 = Counter(w for (_, w) in bi_types)
        self.n1_total = sum(self.n1.values())
        self.d3 = self._discount(tri.values())
        self.d2 = self._discount(self.n2.values())
        self.d1 = self._discount(self.n1.values())
        self._p1_floor = self.d1 * len(self.n1) / self.n1_total / self.vocab_size
        self._p2_cache: dict[int, dict] = defaultdict(dict)
        return self

    @staticmethod
    def _discount(counts) -> float:
        hist = Counter(c for c in counts if c <= 2)
        n1, n2 = hist[1], hist[2]
        return n1 / (n1 + 2 * n2) if n1 + n2 else 0.75

    def p1(self, w: int) -> float:
        return max(self.n1[w] - self.d1, 0) / self.n1_total + self._p1_floor

    def p2(self, v: int, w: int) -> float:
        ctx = self.n2_ctx[v]
        if not ctx:
            return self.p1(w)
        return (max(self.n2[v, w] - self.d2, 0) + self.d2 * self.n2_types[v] * self.p1(w)) / ctx

    def p3(self, u: int, v: int, w: int) -> float:
        ctx = self.c3_ctx[u, v]
        if not ctx:
            return self.p2(v, w)
        return (max(self.c3[u, v, w] - self.d3, 0) + self.d3 * self.n3_ctx[u, v] * self.p2(v, w)) / ctx

    def nll(self, ids: list[int], seq_len: int) -> tuple[float, int]:
        """Summed NLL (nats) and predicted-token count over the same windows the transformer sees."""
        total, count = 0.0, 0
        for win in windows(ids, seq_len):
            for t in range(1, len(win)):
                p = self.p3(win[t - 2], win[t - 1], win[t]) if t >= 2 else self.p2(win[t - 1], win[t])
                total -= math.log(p)
                count += 1
        return total, count


# --------------------------------------------------------------------------------------------------
# Putting it together
# --------------------------------------------------------------------------------------------------


def load_tokenizer(path):
    """The raw `tokenizers.Tokenizer` of a model directory (or a tokenizer.json)."""
    return Tokenizer.from_file(path).tok


def evaluate_model(model_dir, split: str = "val", max_tokens: int | None = None, seq_len: int | None = None,
                   corpus=data.CORPUS_DIR, device: str | None = "cpu", batch_size: int = 8) -> Score:
    """Load a model directory (or "target"/"draft", the shipped models) in float32 and score it on a split
    (or its first max_tokens tokens)."""
    model_dir = resolve_model_path(model_dir)
    tokenizer = load_tokenizer(model_dir)
    ids = split_ids(tokenizer, split, corpus, max_tokens)  # an empty split is refused before the model loads
    model = load_model(model_dir, device=device, dtype=torch.float32)
    seq_len = seq_len or model.config.max_seq_len
    nll, n = model_nll(model, ids, seq_len, batch_size)
    return Score(Path(model_dir).name, split, n, count_bytes(tokenizer, ids), nll)


def evaluate_ngram(tokenizer, split: str, seq_len: int, max_tokens: int | None = None,
                   corpus=data.CORPUS_DIR, model: KneserNeyTrigram | None = None) -> Score:
    model = model or KneserNeyTrigram(tokenizer.get_vocab_size()).fit(split_ids(tokenizer, "train", corpus))
    ids = split_ids(tokenizer, split, corpus, max_tokens)
    nll, n = model.nll(ids, seq_len)
    return Score("kneser-ney-trigram", split, n, count_bytes(tokenizer, ids), nll)


def format_table(scores: list[Score]) -> str:
    """A Markdown table: one row per (model, split)."""
    rows = ["| model | split | tokens | bytes | loss (nats/token) | perplexity | bits/byte |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for s in scores:
        rows.append(f"| {s.name} | {s.split} | {s.tokens:,} | {s.bytes:,} | {s.loss:.4f} | "
                    f"{s.perplexity:.2f} | {s.bits_per_byte:.4f} |")
    return "\n".join(rows)


def update_card(model_dir, table: str, note: str) -> None:
    """Replace the evaluation section of MODEL_DIR/README.md (between the eval markers) with `table`."""
    card = Path(model_dir) / "README.md"
    if not card.is_file():
        raise FileNotFoundError(f"{card}: no model card to update")
    text = card.read_text()
    section = f"{CARD_START}\n{note}\n\n{table}\n{CARD_END}"
    pattern = re.compile(re.escape(CARD_START) + ".*?" + re.escape(CARD_END), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    elif "\n## Evaluation\n" in text:  # a card without markers yet: fill its (empty) Evaluation section
        head, tail = text.split("\n## Evaluation\n", 1)
        text = f"{head}\n## Evaluation\n\n{section}\n\n{tail.lstrip()}"
    else:
        text = text.rstrip() + "\n\n## Evaluation\n\n" + section + "\n"
    atomic_write_text(card, text)


def golden(model_dir, prompt: str, max_new_tokens: int) -> dict:
    """Greedy continuation of `prompt` by the float32 model on the CPU, via `llmstep.generate`."""
    model, tokenizer = load(model_dir, device="cpu", dtype=torch.float32)
    out = generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens, temperature=0.0)
    return {"prompt": prompt, "max_new_tokens": max_new_tokens, "temperature": 0.0, "dtype": "float32",
            "tokens": [int(t) for t in out.tokens], "text": out.text}


def model_window(model_dir, seq_len: int | None = None) -> int:
    """The window a model is scored in: seq_len, or by default the model's own context."""
    return seq_len or LlamaConfig.from_hf(model_dir).max_seq_len


def check_models(models: list[Path], seq_len: int | None = None, golden_prompt: str | None = None,
                 cards: bool = False, max_tokens: int | None = None, write_eval_json: bool = False) -> None:
    """What evaluate_models (and, with `cards`, update_card) would refuse, before any scoring or writing: a model
    that is not a checkpoint directory (a GGUF file, a registry name), windows longer than a model's context, an
    empty golden prompt, a slice of fewer than 2 tokens, a model with no card to update, a file it would write
    (eval.json, golden.json, README.md) that cannot be written (a read-only model folder)."""
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2 (context and a prediction), got {max_tokens}")
    if golden_prompt == "":
        raise ValueError("the golden prompt is empty: give the text whose greedy continuation to record")
    for model_dir in models:
        if not Path(model_dir).is_dir():
            raise ValueError(f"{model_dir}: llmstep eval scores a checkpoint directory (config.json, "
                             "model.safetensors, tokenizer.json), not a file")
        context = LlamaConfig.from_hf(model_dir).max_seq_len
        if seq_len is not None and seq_len > context:
            raise ValueError(f"seq_len {seq_len} is longer than {model_dir}'s context ({context} tokens)")
        if cards and not (Path(model_dir) / "README.md").is_file():
            raise ValueError(f"{Path(model_dir) / 'README.md'}: no model card to update")
        written = {"eval.json": write_eval_json, "golden.json": golden_prompt is not None, "README.md": cards}
        for name in (name for name, on in written.items() if on):
            check_output_path(Path(model_dir) / name, f"the model's {name}")


def evaluate_models(models=tuple(SHIPPED), splits=("val", "test"), corpus=data.CORPUS_DIR,
                    max_tokens: int | None = None, seq_len: int | None = None, batch_size: int = 8,
                    baseline: bool = True, write_eval_json: bool = False, golden_prompt: str | None = None,
                    golden_tokens: int = 40) -> tuple[list[Score], dict]:
    """(scores, settings): every model directory (or shipped name: "target", "draft", the default both) on every
    split, then the n-gram baseline (fitted once, on the first model's tokenizer). With write_eval_json each
    model's own scores go to MODEL/eval.json; with a golden_prompt its greedy continuation goes to MODEL/golden.json."""
    scores: list[Score] = []
    settings = {"max_tokens": max_tokens, "corpus": Path(corpus).name, "dtype": "float32"}
    window = seq_len
    models = [resolve_model_path(m) for m in models]  # a missing model is refused before any scoring
    check_models(models, seq_len, golden_prompt, max_tokens=max_tokens, write_eval_json=write_eval_json)
    if baseline:  # fitted first: an unusable train split is refused before any model is scored or file written
        tokenizer = load_tokenizer(models[0])
        kn = KneserNeyTrigram(tokenizer.get_vocab_size()).fit(split_ids(tokenizer, "train", corpus))
    for model_dir in models:
        own = [evaluate_model(model_dir, split, max_tokens, seq_len, corpus, "cpu", batch_size) for split in splits]
        scores += own
        if window is None:
            window = model_window(model_dir)
        if write_eval_json:
            own_settings = settings | {"seq_len": model_window(model_dir, seq_len)}
            record = {"settings": own_settings, "scores": [s.to_dict() for s in own]}
            atomic_write_json(Path(model_dir) / "eval.json", record)
        if golden_prompt is not None:
            record = golden(model_dir, golden_prompt, golden_tokens)
            atomic_write_json(Path(model_dir) / "golden.json", record)
    if baseline:
        scores += [evaluate_ngram(tokenizer, split, window or 512, max_tokens, corpus, kn) for split in splits]
    return scores, settings | {"seq_len": window}


def card_note(seq_len: int | None, max_tokens: int | None = None, rows: dict[str, int] | None = None) -> str:
    """The sentence above the table in a model card: how the scores were made. seq_len is the window of the card's
    own model; rows (the table's row names -> their windows) names those scored in other windows."""
    sliced = "" if max_tokens is None else f", first {max_tokens} tokens"
    other = ", ".join(f"{w} for {name}" for name, w in (rows or {}).items() if w != seq_len)
    other = f" ({other})" if other else ""
    return (f"Held-out scores from `llmstep eval` (float32 on the CPU, windows of {seq_len} "
            f"tokens{other}{sliced}); val is {', '.join(data.VAL_WORKS)}, test is {', '.join(data.TEST_WORKS)}, "
            "neither seen in training.")
