"""Every builder makes its model the same way (llmstep.core.model.materialize): inference-ready, with no
autograd graph, and a tied LM head that is the embedding itself, not a copy of it."""

import pytest
import torch
from conftest import make_checkpoint

import llmstep
from llmstep.core.model import materialize
from llmstep.core.quantize import QuantConfig, quantize
from llmstep.lab.hardware import random_model


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory, tokenizer_file):
    path = tmp_path_factory.mktemp("tied")
    make_checkpoint(path, tokenizer_file, tie_word_embeddings=True)
    return path


def _quantised_checkpoint(path, tmp_path, spec):
    model, tok = llmstep.load(path, device="cpu", dtype=torch.float32)
    return llmstep.save(quantize(model, spec), tmp_path / "q", tokenizer=tok)


BUILDERS = {
    "load_model": lambda path, tmp: llmstep.load_model(path, device="cpu", dtype=torch.float32),
    "load": lambda path, tmp: llmstep.load(path, device="cpu", dtype=torch.float32)[0],
    "load of a quantised checkpoint": lambda path, tmp: llmstep.load_model(
        _quantised_checkpoint(path, tmp, "int8"), device="cpu", dtype=torch.float32),
    "quantize(inplace=False)": lambda path, tmp: quantize(
        llmstep.load_model(path, device="cpu", dtype=torch.float32), QuantConfig("int4", 16), inplace=False),
    "random_model": lambda path, tmp: random_model(llmstep.LlamaConfig.from_hf(path), "cpu", torch.float32),
}


@pytest.mark.parametrize("builder", list(BUILDERS))
@pytest.mark.parametrize("tie", [False, True])
def test_every_builder_gives_an_inference_model_with_its_head_tied_to_the_embedding(
        builder, tie, tiny_checkpoint, tied_checkpoint, tmp_path):
    path = tied_checkpoint if tie else tiny_checkpoint
    model = BUILDERS[builder](path, tmp_path)
    assert model.config.tie_embeddings == tie
    assert not any(p.requires_grad for p in model.parameters()), "an inference model must not build a graph"
    assert not model.training
    assert (model.output.weight is model.tok_embeddings.weight) == tie  # the same tensor, not an equal copy
    assert model.inv_freq.device == model.device and isinstance(model.generation_config, dict)
    logits = model(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, model.config.vocab_size) and logits.grad_fn is None
    assert torch.isfinite(logits).all()


def test_materialize_holds_the_tensors_it_is_given(tiny_checkpoint):
    """No copy: the model's parameters are the state dict's tensors, and inv_freq comes from the config."""
    model = llmstep.load_model(tiny_checkpoint, device="cpu", dtype=torch.float32)
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "output.weight"}
    state["output.weight"] = state["tok_embeddings.weight"] if model.config.tie_embeddings else \
        model.state_dict()["output.weight"].clone()
    twin = materialize(model.config, state, {"temperature": 0.5})
    assert twin.tok_embeddings.weight.data_ptr() == state["tok_embeddings.weight"].data_ptr()
    assert twin.generation_config == {"temperature": 0.5}
    assert torch.equal(twin.inv_freq, model.inv_freq)
    tokens = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(twin(tokens), model(tokens))


def test_random_model_draws_the_same_weights_for_the_same_seed(tiny_checkpoint):
    config = llmstep.LlamaConfig.from_hf(tiny_checkpoint)
    a, b = random_model(config, "cpu", torch.float32, seed=3), random_model(config, "cpu", torch.float32, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert float(a.layers[0].attention.wq.weight.std()) == pytest.approx(0.02, rel=0.1)
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
