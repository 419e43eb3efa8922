"""What read_gguf refuses before a weight is read (a header count or length the file cannot hold, a tensor table that
does not tile the data section, a bad general.alignment, a rope scaling llmstep does not implement, a rope_freqs
tensor of the wrong shape, a chat template that is not Jinja, a file cut after its magic) and what export keeps (the
sampling defaults; a dequantized model's weights, unrounded by default). Files are written by export_gguf, then
rewritten or patched byte by byte with the gguf package's reader and writer."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
import torch
from gguf_oracle import random_llama

from llmstep import cli
from llmstep.core.config import RopeScaling
from llmstep.core.gguf import GGUFError, export_gguf
from llmstep.core.gguf_load import GGUFLoadError, load_gguf, read_gguf
from llmstep.core.tokens import Tokenizer

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_file) -> Tokenizer:
    return Tokenizer.from_file(tokenizer_file)


@pytest.fixture
def no_weight_read(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a weight was read before the file was refused")

    monkeypatch.setattr(gguf.quants, "dequantize", boom)


def rewrite(src, dst, fields: dict | None = None, tensors=lambda name, array, kind: (array, kind)):
    """Copy the GGUF file `src` to `dst`: metadata `fields` added or replaced (key -> (value, GGUFValueType[, an
    array's item type])),
    every tensor passed through `tensors(name, array, type name) -> (array, type name)` (arrays of F32 files)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), "llama")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in (fields or {}):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for key, (value, kind, *sub) in (fields or {}).items():
        w.add_key_value(key, value, kind, sub_type=sub[0] if sub else None)
    for t in r.tensors:
        array, kind = tensors(t.name, np.array(t.data), t.tensor_type.name)
        w.add_tensor(t.name, array, raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def patch_entry(path, name: str, offset: int | None = None, kind: str | None = None):
    """Overwrite tensor `name`'s table entry in place: its data offset and/or its GGML type."""
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    at = t.field.offset + sum(p.nbytes for p in t.field.parts[:-2])  # the type (uint32), then the offset (uint64)
    data = bytearray(path.read_bytes())
    if kind is not None:
        data[at:at + 4] = struct.pack("<I", int(gguf.GGMLQuantizationType[kind]))
    if offset is not None:
        data[at + 4:at + 12] = struct.pack("<Q", offset)
    path.write_bytes(bytes(data))
    return int(t.field.parts[-1][0])


@pytest.mark.parametrize(("change", "match"), [
    ("offset+2", r"blk.0.attn_q.weight \(BF16 \[64, 64\], 8192 bytes\) starts at data offset \d+, expected \d+ "
                 r"\(not a multiple of general.alignment 32\)"),
    ("offset0", r"blk.0.attn_q.weight \(BF16 \[64, 64\], 8192 bytes\) starts at data offset 0, expected \d+ "
                r"\(before the end of blk.0.attn_norm.weight"),
    ("Q8_0", r"blk.0.attn_k.weight .*\(leaving a gap after blk.0.attn_q.weight \(Q8_0, 4352 bytes"),
    ("F32", r"blk.0.attn_k.weight .*\(before the end of blk.0.attn_q.weight \(F32, 16384 bytes"),
])
def test_a_tensor_table_entry_that_does_not_tile_the_data_is_refused_naming_the_tensor(tmp_path, tokenizer,
                                                                                         no_weight_read, change, match):
    path = export_gguf(random_llama(), tokenizer, tmp_path / "m.gguf", dtype="bf16")
    if change.startswith("offset"):
        old = patch_entry(path, "blk.0.attn_q.weight")
        patch_entry(path, "blk.0.attn_q.weight", offset=old + 2 if change == "offset+2" else 0)
    else:  # the same shape in another type: its size no longer fits the space the table leaves it
        patch_entry(path, "blk.0.attn_q.weight", kind=change)
    with pytest.raises(GGUFLoadError, match=match):
        load_gguf(path, device="cpu")


def test_an_untouched_file_tiles_its_data_section_and_loads(tmp_path, tokenizer):
    model = random_llama()
    path = export_gguf(model, tokenizer, tmp_path / "m.gguf", dtype="f32")
    got, _ = load_gguf(path, device="cpu")
    assert torch.equal(got.layers[0].attention.wq.weight, model.layers[0].attention.wq.weight)


def test_a_tensor_without_dimensions_is_refused_by_name(tmp_path, tokenizer):
    """A 0-d entry has no rows to hold blocks: named, not an IndexError from the layout check."""
    r = gguf.GGUFReader(export_gguf(random_llama(), tokenizer, tmp_path / "m.gguf", dtype="f32"))
    w = gguf.GGUFWriter(str(tmp_path / "scalar.gguf"), "llama")
    for key, f in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(1.0, dtype=np.float32) if t.name == "output_norm.weight" else np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFLoadError, match=r"tensor output_norm.weight has shape \[\]"):
        read_gguf(tmp_path / "scalar.gguf")


@pytest.mark.parametrize("value", [(3, "UINT32"), (0, "UINT32"), ("32", "STRING")])
def test_a_general_alignment_that_is_not_a_power_of_two_is_refused_by_name(tmp_path, tokenizer, value):
    path = export_gguf(random_llama(), tokenizer, tmp_path / "m.gguf", dtype="f32")
    bad = rewrite(path, tmp_path / "bad.gguf", {"general.alignment": (value[0], gguf.GGUFValueType[value[1]])})
    with pytest.raises(GGUFLoadError, match="general.alignment must be a uint32 power of two"):
        read_gguf(bad)


def test_a_power_of_two_alignment_other_than_32_loads(tmp_path, tokenizer):
    model = random_llama()
    path = export_gguf(model, tokenizer, tmp_path / "m.gguf", dtype="f32")
    r = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(tmp_path / "a64.gguf"), "llama")
    w.data_alignment = 64  # what add_custom_alignment sets, with the key written below
    for key, f in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    w.add_uint32("general.alignment", 64)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf.GGUFReader(tmp_path / "a64.gguf").alignment == 64
    got, _ = load_gguf(tmp_path / "a64.gguf", device="cpu")
    assert torch.equal(got.output.weight, model.output.weight)


def test_rope_freqs_that_is_not_one_factor_per_pair_is_refused_by_shape(tmp_path, tokenizer):
    scaling = RopeScaling(factor=8.0, original_max_position_embeddings=16)
    path = export_gguf(random_llama(rope_scaling=scaling), tokenizer, tmp_path / "m.gguf", dtype="f32")
    assert read_gguf(path).config.rope_scaling is not None  # head_dim 8: 4 factors, read back

    def two_rows(name, array, kind):
        return (array.reshape(2, -1), kind) if name == "rope_freqs.weight" else (array, kind)

    bad = rewrite(path, tmp_path / "bad.gguf", tensors=two_rows)
    with pytest.raises(GGUFLoadError, match=r"rope_freqs.weight has shape \[2, 2\]; it must be 1-D with 4 factors"):
        read_gguf(bad)


def test_a_chat_template_that_is_not_jinja_is_refused_when_the_file_is_read(tmp_path, tokenizer, no_weight_read):
    path = export_gguf(random_llama(), tokenizer, tmp_path / "m.gguf", dtype="f32")
    key = "tokenizer.chat_template"
    bad = rewrite(path, tmp_path / "bad.gguf", {key: ("{% for x in %}", gguf.GGUFValueType.STRING)})
    with pytest.raises(GGUFLoadError, match="tokenizer.chat_template: the chat template is not valid Jinja: line 1"):
        read_gguf(bad)
    refusing = "{{ raise_exception('no chats') }}"  # valid Jinja that fails only when used: the file still loads
    fine = rewrite(path, tmp_path / "fine.gguf", {key: (refusing, gguf.GGUFValueType.STRING)})
    assert read_gguf(fine).tokenizer.chat_template == refusing


def test_a_file_cut_right_after_its_magic_is_called_truncated(tmp_path):
    for content in (b"GGUF", b"GGUF\x03\x00\x00\x00"):
        (tmp_path / "cut.gguf").write_bytes(content)
        with pytest.raises(GGUFLoadError, match=r"truncated GGUF file \(\d+ bytes"):
            read_gguf(tmp_path / "cut.gguf")


# ---- export keeps what the loader reads ----------------------------------------------------------------------
@pytest.mark.parametrize(("gen", "expected"), [
    ({"do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 40}, {"temperature": 0.8, "top_p": 0.95,
                                                                          "top_k": 40, "do_sample": True}),
    ({"do_sample": False, "temperature": 0.6, "top_p": 0.9}, {"temperature": 0.0, "top_p": 0.9, "do_sample": False}),
    ({"temperature": 0.6, "top_p": 0.9}, {"temperature": 0.0, "top_p": 0.9, "do_sample": False}),  # greedy
    ({"do_sample": True, "top_k": 40}, {"top_k": 40, "do_sample": True}),  # llama.cpp samples at its own temperature
    ({}, {}),
])
def test_the_sampling_defaults_survive_an_export_and_a_load(tmp_path, tokenizer, gen, expected):
    model = random_llama()
    model.generation_config = gen
    path = export_gguf(model, tokenizer, tmp_path / "m.gguf", dtype="f32")
    got = read_gguf(path).generation_config
    assert {k: v for k, v in got.items() if k != "eos_token_id"} == expected


def test_a_top_k_past_int32_is_refused_before_the_file_is_opened(tmp_path, tokenizer):
    model = random_llama()
    model.generation_config = {"top_k": 2**31}  # generation_config allows it; general.sampling.top_k is int32
    with pytest.raises(GGUFError, match="top_k 2147483648 does not fit general.sampling.top_k"):
        export_gguf(model, tokenizer, tmp_path / "m.gguf", dtype="f32")
    assert list(tmp_path.iterdir()) == []


def q4_1_file(tmp_path, tokenizer):
    """A file whose matrices are Q4_1 (norms F32), as llama.cpp's quantize writes one."""
    path = export_gguf(random_llama(), tokenizer, tmp_path / "f32.gguf", dtype="f32")

    def q4(name, array, kind):
        return (gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q4_1), "Q4_1") if array.ndim == 2 else (
            array, kind)

    return rewrite(path, tmp_path / "q4_1.gguf", tensors=q4)


def test_exporting_a_dequantized_q4_1_model_by_default_rounds_nothing(tmp_path, tokenizer):
    model, tok = load_gguf(q4_1_file(tmp_path, tokenizer), device="cpu")
    assert model.config.torch_dtype == "bfloat16"  # what a GPU loads it in; d * q + m is rarely a bfloat16
    path = export_gguf(model, tok, tmp_path / "again.gguf")
    assert {t.tensor_type.name for t in gguf.GGUFReader(path).tensors} == {"F32"}
    again, _ = load_gguf(path, device="cpu")
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_the_export_command_says_which_type_it_wrote_a_quantized_file_in(tmp_path, tokenizer, capsys):
    out = tmp_path / "out.gguf"
    cli.main(["export", "--gguf", str(out), "--model", str(q4_1_file(tmp_path, tokenizer))])
    assert {t.tensor_type.name for t in gguf.GGUFReader(out).tensors} == {"F32"}
    assert "matrices f32 (not the checkpoint's bfloat16, which would round its weights)" in capsys.readouterr().err


def _field_offset(path, key: str) -> int:
    """Where metadata `key`'s entry begins: its key's u64 length."""
    return gguf.GGUFReader(path).fields[key].offset


@pytest.mark.parametrize(("key", "patch", "match"), [
    # the u64 count of an array: 2**40 int32 token types (the reader walked the file item by item, for minutes)
    ("tokenizer.ggml.token_type", lambda at, key: (at + 8 + len(key) + 8, "<Q", 2**40),
     r"metadata tokenizer.ggml.token_type claims 1,099,511,627,776 int32 items, which take at least "
     r"4,398,046,511,104 bytes; [\d,]+ are left"),
    # an array of strings whose item type says array: an array of arrays (the reader took gigabytes)
    ("tokenizer.ggml.tokens", lambda at, key: (at + 8 + len(key) + 4, "<I", 9),
     "metadata tokenizer.ggml.tokens is an array of arrays, which llama.cpp does not read"),
    # a string's u64 length past the end
    ("general.architecture", lambda at, key: (at + 8 + len(key) + 4, "<Q", 2**50),
     r"metadata general.architecture is 1,125,899,906,842,624 bytes long, more than the [\d,]+ left"),
    ("general.architecture", lambda at, key: (at + 8 + len(key), "<I", 77),
     "metadata general.architecture has value type 77, which GGUF does not have"),
])
def test_a_header_count_or_length_the_file_cannot_hold_is_refused_at_once_by_its_key(tmp_path, tokenizer, key, patch,
                                                                                       match, no_weight_read,
                                                                                       monkeypatch):
    path = export_gguf(random_llama(), tokenizer, tmp_path / "m.gguf", dtype="f32")
    where, fmt, value = patch(_field_offset(path, key), key)
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, where, value)
    path.write_bytes(bytes(data))
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("the reader was handed a lying header"))
    with pytest.raises(GGUFLoadError, match=match):
        read_gguf(path)


def test_the_header_counts_of_tensors_and_metadata_are_held_to_the_bytes_left(tmp_path, tokenizer):
    path = export_gguf(random_llama(), tokenizer, tmp_path / "m.gguf", dtype="f32")
    data = bytearray(path.read_bytes())
    for at, what in ((8, "tensors"), (16, "metadata entries")):  # after the magic and the version: two u64 counts
        bad = bytearray(data)
        struct.pack_into("<Q", bad, at, 2**60)
        (tmp_path / "bad.gguf").write_bytes(bytes(bad))
        with pytest.raises(GGUFLoadError, match=f"the header claims 1,152,921,504,606,846,976 {what}"):
            read_gguf(tmp_path / "bad.gguf")


def test_a_rope_attn_factor_other_than_one_is_refused_as_llama_cpp_would_scale_q_and_k_by_it(tmp_path, tokenizer):
    path = export_gguf(random_llama(), tokenizer, tmp_path / "m.gguf", dtype="f32")
    for value, loads in ((1.0, True), (2.0, False)):
        out = rewrite(path, tmp_path / f"attn{value}.gguf",
                      {"llama.rope.scaling.attn_factor": (value, gguf.GGUFValueType.FLOAT32)})
        if loads:
            assert read_gguf(out).config.dim == random_llama().config.dim
        else:
            with pytest.raises(GGUFLoadError, match="llama.rope.scaling.attn_factor is 2.0: llama.cpp scales the "
                                                    "rotated q and k by it"):
                read_gguf(out)


def _header(*fields: bytes, tensors: tuple[bytes, ...] = (), version: int = 3, endian: str = "<") -> bytes:
    """A GGUF header: magic, version, the counts, then the entries given as bytes."""
    return (b"GGUF" + struct.pack(f"{endian}IQQ", version, len(tensors), len(fields)) + b"".join(fields)
            + b"".join(tensors))


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _array(key: bytes, item: int, count: int, items: bytes) -> bytes:
    return _string(key) + struct.pack("<IIQ", 9, item, count) + items


def _check(tmp_path, data: bytes):
    from llmstep.core.gguf_header import check_header

    (tmp_path / "h.gguf").write_bytes(data)
    check_header(tmp_path / "h.gguf", GGUFLoadError)


def test_the_header_walk_takes_what_gguf_allows(tmp_path):
    """Empty and bool arrays, empty strings, v2 files, no tensors: nothing refused that the format allows."""
    for version in (2, 3):
        _check(tmp_path, _header(_array(b"a.bools", 7, 3, b"\x01\x00\x01"), _array(b"a.empty", 8, 0, b""),
                                 _string(b"a.text") + struct.pack("<I", 8) + _string(b""),
                                 _string(b"a.f64") + struct.pack("<Id", 12, 0.5), version=version))
    name = _string(b"blk.0.attn_q.weight") + struct.pack("<IQQIQ", 2, 64, 64, 0, 0)
    _check(tmp_path, _header(tensors=(name,)) + b"\0" * 64)


@pytest.mark.parametrize(("data", "match"), [
    (b"GGUF" + struct.pack(">IQQ", 3, 0, 1) + _array(b"k", 0, 2**40, b""), "a big-endian GGUF file"),
    (_header(_string(b"k" * 70_000) + struct.pack("<IB", 0, 1)), "metadata entry 0's key is 70,000 bytes long; GGUF "
                                                                   r"\(llama.cpp\) allows at most 65,535"),
    (_header(tensors=(_string(b"t" * 64) + struct.pack("<IQIQ", 1, 4, 0, 0),)) + b"\0" * 64,
     r"tensor 0's name is 64 bytes long; GGUF \(llama.cpp\) allows at most 63"),
    (_header(_array(b"a", 0, 2**20, b"\0" * 2**20), _array(b"b", 0, 2**20 + 1, b"\0" * (2**20 + 1))),
     "metadata b brings the metadata's array items to 2,097,153; llmstep reads at most 2,097,152"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 2**16 + 1) + b"\0" * 13 * (2**16 + 1),
     "the header claims 65,537 metadata entries; llmstep reads at most 65,536"),
])
def test_the_header_walk_refuses_what_no_model_needs_and_the_reader_would_pay_for(tmp_path, data, match):
    """A big-endian file (the reader would swap it and walk a lying count), a key or tensor name past GGUF's and
    llama.cpp's lengths, more array items or entries than any model's vocabulary: refused before the reader, whose
    object per item cost ~2 KB (a valid 200 KB file of 200,000 bytes in one array took it 440 MiB)."""
    with pytest.raises(GGUFLoadError, match=match):
        _check(tmp_path, data)


@pytest.mark.parametrize(("key", "value", "kind", "match"), [
    ("llama.attention.head_count", 4.0, "FLOAT32", "is a float32; llama.cpp reads it as a uint32 or an array of "
                                                   "int32 or an array of uint32 only"),
    ("llama.block_count", 2, "UINT64", "is a uint64; llama.cpp reads it as a uint32 only"),
    ("llama.rope.freq_base", 10000.0, "FLOAT64", "is a float64; llama.cpp reads it as a float32 only"),
    ("tokenizer.ggml.eos_token_id", 2, "INT64", "is an int64; llama.cpp reads it as a uint32 only"),
    ("tokenizer.ggml.eot_token_id", 2, "INT32", "is an int32; llama.cpp reads it as a uint32 only"),
    ("tokenizer.ggml.add_bos_token", 1, "UINT8", "is a uint8; llama.cpp reads it as a bool only"),
    ("tokenizer.ggml.model", 2, "UINT32", "is a uint32; llama.cpp reads it as a string only"),
    ("llama.context_length", 2048, "INT32", "is an int32; llama.cpp reads it as a uint32 only"),
])
def test_metadata_of_another_type_than_llama_cpp_reads_is_refused_by_key(tmp_path, tokenizer, no_weight_read, key,
                                                                          value, kind, match):
    """llama.cpp refuses such a file ("key ... has wrong type"); llmstep read the value whatever its type."""
    path = export_gguf(random_llama(), tokenizer, tmp_path / "m.gguf", dtype="f32")
    out = rewrite(path, tmp_path / "typed.gguf", {key: (value, gguf.GGUFValueType[kind])})
    with pytest.raises(GGUFLoadError, match=rf"typed.gguf: metadata {re.escape(key)} {match}"):
        read_gguf(out)


def test_token_types_stored_as_floats_are_refused_and_per_block_head_counts_are_named(tmp_path, tokenizer,
                                                                                       no_weight_read):
    path = export_gguf(random_llama(), tokenizer, tmp_path / "m.gguf", dtype="f32")
    types = gguf.GGUFReader(path).fields["tokenizer.ggml.token_type"].contents()
    floats = rewrite(path, tmp_path / "floats.gguf", {"tokenizer.ggml.token_type": ([float(t) for t in types],
                                                                                    gguf.GGUFValueType.ARRAY)})
    with pytest.raises(GGUFLoadError, match="metadata tokenizer.ggml.token_type is an array of float32; llama.cpp "
                                            "reads it as an array of int32 or an array of uint32 only"):
        read_gguf(floats)
    unsigned = rewrite(path, tmp_path / "unsigned.gguf", {"tokenizer.ggml.token_type": (
        [int(t) for t in types], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32)})
    assert read_gguf(unsigned).tokenizer.vocab_size == read_gguf(path).tokenizer.vocab_size  # llama.cpp: C ints too
    sampling = rewrite(path, tmp_path / "sampling.gguf", {"general.sampling.top_k": (40, gguf.GGUFValueType.UINT32),
                                                          "general.sampling.temp": (0.5, gguf.GGUFValueType.FLOAT64)})
    assert read_gguf(sampling).generation_config["top_k"] == 40  # llama.cpp reads these as text, whatever the type
    n_layers = random_llama().config.n_layers
    heads = random_llama().config.n_heads
    for item in ("INT32", "UINT32"):  # gguf-py writes a list as int32 (GGUFWriter.add_head_count([...]))
        per_block = rewrite(path, tmp_path / "per_block.gguf", {"llama.attention.head_count": (
            [heads] * n_layers, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType[item])})
        with pytest.raises(GGUFLoadError, match=rf"metadata llama.attention.head_count gives one value per block "
                                                rf"\({heads}, {heads}"):
            read_gguf(per_block)
