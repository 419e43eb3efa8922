"""A GGUF file's header walked before the `gguf` package's reader reads it: every count and length checked against
the bytes the file has left, and named by its key or tensor.

The reader trusts them: it reads an array one item at a time in Python and keeps an object per item, and past the
end of the file an item reads as empty rather than failing, so one lying count (a vocabulary of 2**40 token types,
an array of arrays) had it run for minutes and take gigabytes from a file of a few megabytes. Here nothing is read
but the header, through a memory map (the weights' pages are never touched), and a count is refused unless its
items could fit in what is left: an array's items take at least 1, 2, 4 or 8 bytes each, a string's 8 (its
length). The layout is GGUF v2/v3's (llama.cpp's ggml/src/gguf.cpp): magic, version, tensor count and metadata
count; each metadata entry a key (u64 length, bytes), a value type (u32) and its value (an array: item type, u64
count, items); each tensor a name, n_dims (u32, at most 4), its dims (u64), a type (u32) and an offset (u64).
Arrays of arrays, big-endian files, keys and tensor names longer than GGUF and llama.cpp allow are refused, and
so are more entries, tensors or array items than any model has (the reader keeps a ~2 KB object for each, whatever
the bytes: `_MOST_ITEMS`, `_MOST_ENTRIES`). The walk keeps each key's value type: `check_types` holds the keys
llmstep reads to the types llama.cpp reads them as (`KEY_TYPES`).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

__all__ = ["check_header", "check_types", "KEY_TYPES", "PER_LAYER"]

# GGUF's value types (gguf.GGUFValueType): their names and the bytes of one fixed-size value
_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
          8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_KEY = 65_535  # the GGUF spec's longest key, in bytes
_MAX_NAME = 63  # llama.cpp's longest tensor name (GGML_MAX_NAME, 64 with its terminating zero)
# The gguf reader keeps a Python object (~2 KB) per metadata entry, array item and tensor, whatever the item's size:
# bounds far above any model's (Llama 3's ~540,000 vocabulary items in all; Gemma's 262,144 tokens) keep a file of
# a few megabytes from costing tens of gigabytes
_MOST_ITEMS = 2**21  # array items, all the metadata's arrays together (Gemma's three arrays: 786,432)
_MOST_ENTRIES = 2**16  # metadata entries, and tensors

# The metadata read here -> the value types llama.cpp reads it as (its loader refuses others: "key ... has wrong
# type"); any tokenizer.ggml.*_token_id is a uint32. Where llama.cpp also takes one value per block (an array, of
# int32 as gguf-py writes a list, or uint32), the loader's value check names it. Not here: the general.sampling.*
# defaults, which llama.cpp reads as text whatever their type.
_U32 = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
        "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
        "vocab_size", "expert_count")
_F32 = ("rope.freq_base", "attention.layer_norm_rms_epsilon", "rope.scaling.factor", "rope.scale_linear",
        "rope.scaling.attn_factor")
PER_LAYER = ("llama.feed_forward_length", "llama.attention.head_count", "llama.attention.head_count_kv")
_INTS = ("array of int32", "array of uint32")  # read as C ints: either
KEY_TYPES = {"general.architecture": ("string",), **{f"llama.{k}": ("uint32",) for k in _U32},
             **{f"llama.{k}": ("float32",) for k in _F32}, **{k: ("uint32", *_INTS) for k in PER_LAYER},
             "llama.rope.scaling.type": ("string",), "tokenizer.ggml.model": ("string",),
             "tokenizer.ggml.pre": ("string",), "tokenizer.ggml.tokens": ("array of string",),
             "tokenizer.ggml.merges": ("array of string",), "tokenizer.ggml.token_type": _INTS,
             "tokenizer.ggml.add_bos_token": ("bool",), "tokenizer.ggml.add_eos_token": ("bool",),
             "tokenizer.chat_template": ("string",)}


class _Walk:
    """A cursor over the file's bytes; every read checked against the end, the error naming `what`."""

    def __init__(self, data, path: Path, error: type[Exception]):
        self.data, self.at, self.path, self.error = data, 0, path, error

    def left(self) -> int:
        return len(self.data) - self.at

    def fail(self, message: str):
        raise self.error(f"{self.path}: {message} (the file ends {len(self.data):,} bytes in): a truncated or corrupt "
                         f"GGUF file")

    def refuse(self, message: str):
        raise self.error(f"{self.path}: {message}")

    def number(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        if self.left() < size:
            self.fail(f"{what} runs past the end of the file")
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return value

    def string(self, what: str, most: int | None = None) -> str:
        """A string (its u64 length, its bytes), at most `most` bytes long where given; quoted short."""
        n = self.number("<Q", f"{what}'s length")
        if n > self.left():
            self.fail(f"{what} is {n:,} bytes long, more than the {self.left():,} left")
        if most is not None and n > most:
            self.refuse(f"{what} is {n:,} bytes long; GGUF (llama.cpp) allows at most {most:,}")
        text = self.data[self.at:self.at + min(n, 80)].decode("utf-8", "replace") + ("..." if n > 80 else "")
        self.at += n
        return text

    def items(self, kind: int, count: int, what: str) -> None:
        """Skip `count` values of type `kind`, refusing a count whose items cannot fit before reading any."""
        least = 8 if kind == _STRING else _SIZES[kind]
        if count * least > self.left():
            self.fail(f"{what} claims {count:,} {_NAMES[kind]} items, which take at least {count * least:,} bytes; "
                      f"{self.left():,} are left")
        if kind != _STRING:
            self.at += count * least
            return
        for i in range(count):
            n = self.number("<Q", f"{what}[{i}]'s length")
            if n > self.left():
                self.fail(f"{what}[{i}] is {n:,} bytes long, more than the {self.left():,} left")
            self.at += n


def check_header(path: Path, error: type[Exception]) -> dict[str, str]:
    """Walk the header of the GGUF file at `path` (its magic already checked), raising `error` for the first count
    or length the file's bytes cannot hold, named by its key or tensor. Returns each metadata key's value type as
    GGUF names it ("uint32", "string", "array of int32", ...); empty for a version the walk does not know."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _walk(_Walk(data, path, error))


def check_types(types: dict[str, str], path: Path, error: type[Exception]) -> None:
    """Refuse metadata llmstep reads (KEY_TYPES) whose value type is not one llama.cpp reads it as, naming the key:
    a head count stored as a float, a token id as an int64, token types as floats."""
    for key, kind in types.items():
        token_id = key.startswith("tokenizer.ggml.") and key.endswith("_token_id")
        want = KEY_TYPES.get(key, ("uint32",) if token_id else ())
        if want and kind not in want:
            raise error(f"{path}: metadata {key} is {_a(kind)}; llama.cpp reads it as {' or '.join(map(_a, want))} "
                        "only, and so does llmstep")


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "ai" else f"a {kind}"


def _walk(walk: _Walk) -> dict[str, str]:
    walk.number("<I", "the magic")
    version = walk.number("<I", "the version")
    if version & 0xFFFF == 0 and version:  # 2 or 3 written big-endian
        raise walk.error(f"{walk.path} is a big-endian GGUF file; llmstep (as llama.cpp) reads little-endian ones")
    if version not in (2, 3):
        return {}  # the reader names the version it does not read
    n_tensors = walk.number("<Q", "the tensor count")
    n_fields = walk.number("<Q", "the metadata count")
    if n_fields * 13 > walk.left():  # a key's length (8), its value type (4), at least a byte of value
        walk.fail(f"the header claims {n_fields:,} metadata entries, more than the bytes left could hold")
    for count, what in ((n_fields, "metadata entries"), (n_tensors, "tensors")):
        if count > _MOST_ENTRIES:
            walk.refuse(f"the header claims {count:,} {what}; llmstep reads at most {_MOST_ENTRIES:,} (no model has "
                        f"more, and the gguf reader keeps an object for each)")
    items = 0  # array items so far
    types = {}
    for i in range(n_fields):
        key = walk.string(f"metadata entry {i}'s key", _MAX_KEY)
        kind = walk.number("<I", f"metadata {key}'s value type")
        if kind not in _NAMES:
            walk.refuse(f"metadata {key} has value type {kind}, which GGUF does not have")
        if kind == _STRING:
            walk.string(f"metadata {key}")
        elif kind == _ARRAY:
            item = walk.number("<I", f"metadata {key}'s item type")
            if item == _ARRAY:
                walk.refuse(f"metadata {key} is an array of arrays, which llama.cpp does not read")
            if item not in _NAMES:
                walk.refuse(f"metadata {key} is an array of value type {item}, which GGUF does not have")
            count = walk.number("<Q", f"metadata {key}'s item count")
            walk.items(item, count, f"metadata {key}")
            types[key] = f"array of {_NAMES[item]}"
            items += count
            if items > _MOST_ITEMS:
                walk.refuse(f"metadata {key} brings the metadata's array items to {items:,}; llmstep reads at most "
                            f"{_MOST_ITEMS:,} (far above any vocabulary: the gguf reader keeps an object for each)")
        else:
            walk.items(kind, 1, f"metadata {key}")
        types.setdefault(key, _NAMES[kind])
    if n_tensors * 32 > walk.left():  # a name's length, n_dims, one dim, the type, the offset
        walk.fail(f"the header claims {n_tensors:,} tensors, more than the bytes left could describe")
    for i in range(n_tensors):
        name = walk.string(f"tensor {i}'s name", _MAX_NAME)
        n_dims = walk.number("<I", f"tensor {name}'s n_dims")
        if n_dims > _MAX_DIMS:
            walk.refuse(f"tensor {name} has {n_dims:,} dimensions; GGUF (llama.cpp) allows at most {_MAX_DIMS}")
        walk.items(10, n_dims, f"tensor {name}'s dims")
        walk.number("<I", f"tensor {name}'s type")
        walk.number("<Q", f"tensor {name}'s offset")
    return types
