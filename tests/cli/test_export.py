"""`llmstep export --gguf OUT`: writes the shipped model as a GGUF file; a bad dtype or an output path that is a
directory ends the command with one line and exit status 2, before the model is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmstep import cli

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'llmstep[export]')")


def test_export_is_a_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["export", "--help"])
    assert e.value.code == 0 and "--gguf OUT" in capsys.readouterr().out


def test_export_writes_the_shipped_model_as_gguf(tmp_path, capsys):
    out = tmp_path / "shakespeare.gguf"
    cli.main(["export", "--gguf", str(out), "--dtype", "bf16"])
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.name"].contents() == "shakespeare-target"
    assert reader.fields["llama.block_count"].contents() == 6
    assert f"wrote {out}" in capsys.readouterr().err


def test_an_unknown_dtype_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["export", "--gguf", str(tmp_path / "m.gguf"), "--dtype", "q4_k"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid choice: 'q4_k'" in err and len(err.splitlines()) == 1


def test_an_output_that_is_a_directory_is_refused_before_the_model_is_read(tmp_path, capsys, monkeypatch):
    import llmstep.core.checkpoint as checkpoint

    def never(*args, **kwargs):
        raise AssertionError("the model was read")

    monkeypatch.setattr(checkpoint, "load", never)
    with pytest.raises(SystemExit) as e:
        cli.main(["export", "--gguf", str(tmp_path)])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"llmstep export: error: GGUF path {tmp_path} is a directory; give a file name\n"


def test_a_model_that_fails_to_load_leaves_no_output_directory_behind(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF")  # cut after the magic
    out = tmp_path / "nd" / "deep" / "out.gguf"
    with pytest.raises(SystemExit) as e:
        cli.main(["export", "--gguf", str(out), "--model", str(bad)])
    assert e.value.code == 2 and "truncated GGUF file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]  # no nd/, no nd/deep/


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no file can be made")
def test_an_output_directory_where_no_file_can_be_made_is_refused_by_name_before_the_model_is_read(capsys,
                                                                                                   monkeypatch):
    import llmstep.core.checkpoint as checkpoint

    def never(*args, **kwargs):
        raise AssertionError("the model was read")

    monkeypatch.setattr(checkpoint, "load", never)
    with pytest.raises(SystemExit) as e:
        cli.main(["export", "--gguf", "/proc/x.gguf"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("llmstep export: error: GGUF path /proc/x.gguf: cannot create a file "
                                                "in /proc (") and ".tmp" not in err


def test_an_int4_checkpoint_is_refused_from_its_config_before_its_weights_are_read(tmp_path, capsys, monkeypatch):
    import llmstep
    import llmstep.core.checkpoint as checkpoint
    from llmstep.core.quantize import quantize

    model, tok = llmstep.load()
    saved = tmp_path / "int4"
    checkpoint.save(quantize(model, "int4-g32"), saved, tok)

    def never(*args, **kwargs):
        raise AssertionError("the model was read")

    monkeypatch.setattr(checkpoint, "load", never)
    with pytest.raises(SystemExit) as e:
        cli.main(["export", "--gguf", str(tmp_path / "m.gguf"), "--model", str(saved)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is int4-g32" in err and "has no exact GGUF form" in err
    assert not (tmp_path / "m.gguf").exists()


def test_an_int8_checkpoint_quantised_in_float32_is_refused_from_its_scales_before_its_weights_are_read(
        tmp_path, capsys, monkeypatch):
    """Q8_0 holds float16 scales: float32 ones would round. One quantised in bfloat16 exports (exactly)."""
    import torch

    import llmstep
    import llmstep.core.checkpoint as checkpoint
    from llmstep.core.quantize import quantize

    model, tok = llmstep.load()  # float32 on the CPU
    checkpoint.save(quantize(model, "int8"), tmp_path / "f32", tok)
    bf16 = llmstep.load(dtype=torch.bfloat16)[0]
    with torch.no_grad():
        bf16.layers[0].feed_forward.w2.weight[3] = 0  # a zero row: a tiny scale, float16's 0, exact all the same
    checkpoint.save(quantize(bf16, "int8"), tmp_path / "bf16", tok)
    real_load = checkpoint.load

    def never(*args, **kwargs):
        raise AssertionError("the model was read")

    monkeypatch.setattr(checkpoint, "load", never)
    with pytest.raises(SystemExit) as e:
        cli.main(["export", "--gguf", str(tmp_path / "m.gguf"), "--model", str(tmp_path / "f32")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "scale" in err and "is not a float16 number" in err and "bfloat16" in err
    assert not (tmp_path / "m.gguf").exists()
    monkeypatch.setattr(checkpoint, "load", real_load)
    cli.main(["export", "--gguf", str(tmp_path / "m.gguf"), "--model", str(tmp_path / "bf16")])
    assert "matrices Q8_0" in capsys.readouterr().err and (tmp_path / "m.gguf").is_file()
