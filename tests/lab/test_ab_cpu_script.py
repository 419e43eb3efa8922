"""scripts/ab_cpu.py parses and checks every variant and flag before it loads or compiles anything: a typo in the
last variant, --rounds 0 or --tokens 1 ended the command only after every earlier variant had compiled. No compile
here: the parsing functions alone, and main stopped before its first model."""

from __future__ import annotations

import pytest
from conftest import import_script


@pytest.fixture(scope="module")
def script():
    return import_script("ab_cpu.py")


@pytest.fixture
def no_work(script, monkeypatch):
    """main may parse and read the model's config, nothing more."""
    for name in ("build", "attention_of", "withheld_kernels"):
        monkeypatch.setattr(script, name, lambda *a, **k: pytest.fail("went past the checks"))


def test_the_documented_variants_parse(script):
    assert script.parse_variant("bfloat16") == {
        "spec": "bfloat16", "dtype": "bfloat16", "base": "bfloat16", "kernel": "auto", "lm_head": False, "fuse": None,
        "nodot": False, "withhold": None, "attention": "kernel", "stream": None, "isa": None, "overrides": {}}
    v = script.parse_variant("int4@float32+reduce^int8!nofuse~nodot%sdpa&nostream|max_autotune=True;x='A,B'")
    assert (v["dtype"], v["base"], v["kernel"], v["lm_head"], v["fuse"], v["nodot"], v["withhold"], v["attention"],
            v["stream"]) == ("int4", "float32", "reduce", "int8", False, True, "nodot", "sdpa", False)
    assert v["overrides"] == {"max_autotune": True, "x": "A,B"}
    assert script.parse_variant("int8")["base"] == "bfloat16" and script.parse_variant("int8^int8")["lm_head"] == "int8"
    a8 = script.parse_variant("int4-a8^int4-a8")  # int4 with 8-bit activations, its head in the blocks' mode
    assert (a8["dtype"], a8["base"], a8["lm_head"]) == ("int4-a8", "bfloat16", True)
    with pytest.raises(ValueError, match="unknown kernel 'packed' for int4-a8"):
        script.parse_variant("int4-a8+packed")
    a8 = script.parse_variant("int8-a8^int8-a8")  # int8 with 8-bit activations, the head as the blocks
    assert (a8["dtype"], a8["lm_head"]) == ("int8-a8", True)
    assert script.parse_variant("int8-a8^int8")["lm_head"] == "int8"  # a weight-only int8 head under them
    assert script.parse_variant("int4-a8^int8-a8")["lm_head"] == "int8-a8"  # an int8-a8 head under int4-a8 blocks
    with pytest.raises(ValueError, match=r"unknown kernel 'dequant' for int8-a8: it has its own \(llmstep.core.int8a8"):
        script.parse_variant("int8-a8+dequant")
    v = script.parse_variant("int4-a8^int8-a8&nostream=avx2|x=1")  # the 8-bit activation kernels' AVX2 build
    assert (v["lm_head"], v["stream"], v["isa"], v["overrides"]) == ("int8-a8", False, "avx2", {"x": 1})
    assert script.parse_variant("int4^int8-a8=avx512_vnni")["isa"] == "avx512_vnni"  # an int8-a8 head is enough
    assert script.parse_variant("bfloat16%kernel:0")["attention"] == "kernel:0"  # the attention kernel's runs unsplit


def test_an_attention_kernel_with_its_chunk_is_the_kernel_with_that_chunk(script, monkeypatch):
    from llmstep.kernels import cpu_attention

    monkeypatch.setattr(cpu_attention, "install", lambda: True)
    attend, prefix = script.attention_of(script.parse_variant("bfloat16%kernel:64"))
    assert (attend.func, attend.keywords, prefix.func, prefix.keywords) == (
        cpu_attention.attend, {"chunk": 64}, cpu_attention.attend_prefix, {"chunk": 64})
    assert script.attention_of(script.parse_variant("bfloat16")) == script.ATTENTION["kernel"]


@pytest.mark.parametrize("spec, match", [
    ("bf16", "unknown dtype 'bf16'"), ("int8+bogus", "unknown kernel 'bogus'"), ("int8+reduce", "unknown kernel"),
    ("bfloat16+packed", r"\+packed takes a quantised dtype"), ("float32^int8", r"\^int8 takes a quantised dtype"),
    ("int8^int4", "unknown head 'int4'"), ("int8!maybe", "unknown !maybe"), ("int8%bogus", "unknown attention"),
    ("int8%kernel:x", "unknown attention 'kernel:x'"), ("int8%sdpa:64", "or kernel:N"),
    ("int8&fast", "unknown streaming"), ("float32@bfloat16", "@bfloat16 is what int8 / int4 quantise from"),
    ("bfloat16|max_autotune", "KEY=VALUE"), ("int8=avx2", "=avx2: .* for a variant with 8-bit activations"),
    ("int4-a8=sse2", "=sse2: the 8-bit activation kernels' build, one of avx512_vnni, avx2"),
    ("bfloat16|backends=ATEN,CPP", "not a Python literal")])
def test_a_bad_variant_is_named_by_its_part(script, spec, match):
    with pytest.raises(ValueError, match=match):
        script.parse_variant(spec)


def test_a_bad_last_variant_stops_the_command_before_the_first_model(script, no_work):
    with pytest.raises(SystemExit, match="variant 'bfloat16|x=notaliteral'"):
        script.main(["bfloat16", "int8", "bfloat16|x=notaliteral"])
    with pytest.raises(SystemExit, match="variant 'int4': int4 group_size"):  # the model's shapes, from its config
        script.main(["bfloat16", "int4", "--group-size", "7"])


@pytest.mark.parametrize("argv, flag", [(["--rounds", "0"], "--rounds"), (["--tokens", "1"], "--tokens"),
                                        (["--threads", "0"], "--threads"), (["--group-size", "0"], "--group-size")])
def test_a_bad_flag_stops_the_command_before_the_first_model(script, no_work, capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        script.main(["bfloat16", *argv])
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_more_tokens_than_the_context_and_an_unwritable_json_are_refused_first(script, no_work, tmp_path, capsys):
    with pytest.raises(SystemExit, match="more than the model's context"):
        script.main(["bfloat16", "--tokens", "100000"])
    with pytest.raises(SystemExit):
        script.main(["bfloat16", "--json", str(tmp_path)])
    assert "--json path" in capsys.readouterr().err


def test_a_build_this_cpu_does_not_run_stops_the_command_before_the_first_model(script, no_work, monkeypatch):
    monkeypatch.setattr(script.cpu_int4a8, "runs_here", lambda: ("avx2",))
    with pytest.raises(SystemExit, match="'int4-a8=avx512_vnni': this CPU does not run the avx512_vnni build .*avx2"):
        script.main(["int4-a8", "int4-a8=avx512_vnni"])


def test_each_variants_runs_hold_the_build_it_names(script, monkeypatch):
    """Dynamo guards the registered a8 kernel: a variant compiled under `=avx2` but run without it would compile again
    and time the default build. Every generate of a variant runs under its build (fake decoders record which)."""
    import types

    import llmstep.engines.compile as compile_mod
    from llmstep.core import attention_backend, int4a8
    from llmstep.kernels import cpu_int4a8

    if not cpu_int4a8.install():
        pytest.skip(f"the 8-bit activation kernels do not build here: {cpu_int4a8.why()}")
    seen: dict[str, set] = {}

    class Decoder:
        def __init__(self, spec):
            self.spec, self.model = spec, types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=300))

        def generate(self, ids, n, **kw):
            seen.setdefault(self.spec, set()).add(int4a8.kernel_op())
            return types.SimpleNamespace(tokens=[1] * n, decode_steps=n, decode_seconds=0.01)

    monkeypatch.setattr(compile_mod, "cpu_attention", compile_mod.cpu_attention)  # main replaces it: given back
    monkeypatch.setattr(attention_backend, "use_cpu_step_kernel", lambda *a, **k: None)
    monkeypatch.setattr(script, "attention_of", lambda v: (None, None))
    monkeypatch.setattr(script, "build", lambda v, *a, **k: Decoder("=avx2" if v["isa"] else "default"))
    script.main(["int4-a8", "int4-a8=avx2", "--rounds", "2", "--tokens", "4"])
    assert seen == {"default": {f"{cpu_int4a8.ops().name}::mm"}, "=avx2": {"llmstep_int4a8_avx2::mm"}}


def test_every_mark_after_the_attention_or_the_withheld_kernel_is_not_read_as_part_of_it(script):
    assert script.attention_of(script.parse_variant("int4-a8%sdpa=avx2")) == script.ATTENTION["sdpa"]
    v = script.parse_variant("int4~llmstep_int4_avx2%plain&nostream|x=1")
    assert (v["withhold"], v["attention"], v["stream"]) == ("llmstep_int4_avx2", "plain", False)
    assert script.withheld_kernels(script.parse_variant("int8~nodot&stream")) is None  # every kernel: build's word
    with pytest.raises(SystemExit, match="unknown kernel 'bogus' in 'int8~bogus%sdpa': nodot"):
        script.withheld_kernels(script.parse_variant("int8~bogus%sdpa"))
