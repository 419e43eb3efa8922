"""llmstep computes the same function as transformers' LlamaForCausalLM (the reference)."""

import json

import pytest
import torch
from conftest import LLAMA3_SCALING, make_checkpoint
from llmstep.sampling import greedy
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

import llmstep


@pytest.mark.parametrize("hf_checkpoint", ["mqa-sharded-legacy"], indirect=True)
@torch.no_grad()
def test_a_sharded_checkpoint_is_read_from_every_shard(hf_checkpoint):
    """The sharded case really is in several files, and the model read from them is transformers' function."""
    path, ref = hf_checkpoint
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (path / "model.safetensors").exists()
    assert {p.name for p in path.glob("model-*.safetensors")} == shards
    model, _ = llmstep.load(path, dtype="float32")
    tokens = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(tokens), ref(tokens).logits, atol=1e-4, rtol=0)


def test_config_is_read_in_both_forms(hf_checkpoint):
    path, ref = hf_checkpoint
    cfg = llmstep.LlamaConfig.from_hf(path)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.dim) == (ref.config.num_attention_heads,
                                                       ref.config.num_key_value_heads, ref.config.hidden_size)
    assert cfg.rope_theta == 500000.0
    assert cfg.tie_embeddings == ref.config.tie_word_embeddings
    rope_type = ref.config.rope_parameters["rope_type"]
    assert (cfg.rope_scaling is not None) == (rope_type == "llama3")


@torch.no_grad()
def test_logits_match_reference_beyond_original_context(hf_checkpoint):
    path, ref = hf_checkpoint
    model, _ = llmstep.load(path, device="cpu", dtype=torch.float32)
    # 2 sequences of 100 tokens: positions run far past original_max_position_embeddings (16).
    tokens = torch.randint(0, 300, (2, 100), generator=torch.Generator().manual_seed(1))
    ours = model(tokens)
    theirs = ref(tokens).logits
    assert ours.shape == theirs.shape == (2, 100, 300)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@torch.no_grad()
def test_greedy_continuation_with_cache_matches_reference(hf_checkpoint):
    path, ref = hf_checkpoint
    model, tok = llmstep.load(path, device="cpu", dtype=torch.float32)
    prompt = [295, 17, 101, 42, 7, 250, 33]
    out = llmstep.generate(model, tok, prompt, max_new_tokens=40, temperature=0, stop_ids=[])
    theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                          pad_token_id=0, min_new_tokens=40)
    assert out.tokens == theirs[0, len(prompt):].tolist()


@torch.no_grad()
def test_cached_decode_equals_full_recompute_at_every_position(hf_checkpoint):
    path, _ = hf_checkpoint
    model, _ = llmstep.load(path, device="cpu", dtype=torch.float32)
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))
    full = model(tokens)  # [2, 40, V], no cache
    cache = model.new_cache(batch_size=2, max_len=64)
    steps = [model(tokens[:, :8], cache=cache)]  # a prefill of 8, then one token at a time
    steps += [model(tokens[:, t : t + 1], cache=cache) for t in range(8, 40)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    assert cache.lengths.tolist() == [40, 40]


@torch.no_grad()
def test_rollback_then_rewrite_gives_the_same_logits(tiny_checkpoint):
    model, _ = llmstep.load(tiny_checkpoint, device="cpu", dtype=torch.float32)
    tokens = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(3))
    cache = model.new_cache(max_len=32)
    model(tokens[:, :12], cache=cache)
    model(torch.randint(0, 300, (1, 6)), cache=cache)  # 6 tokens that get rejected
    cache.rollback(12)
    resumed = model(tokens[:, 12:], cache=cache)
    torch.testing.assert_close(resumed, model(tokens)[:, 12:], atol=1e-5, rtol=0)


def test_a_rollback_to_a_length_the_cache_cannot_hold_is_refused_with_nothing_changed(tiny_checkpoint):
    """A negative length or one past the cache's slots would fail at the next forward, far from the call; one past
    what a sequence holds would make slots never written count as its keys."""
    model, _ = llmstep.load(tiny_checkpoint, device="cpu", dtype=torch.float32)
    cache = model.new_cache(batch_size=2, max_len=8)
    model(torch.randint(0, 300, (2, 8)), cache=cache)
    cache.rollback(torch.tensor([3, 5]))
    for bad, match in ((-1, "got -1"), (9, "got 9"), (torch.tensor([2, 9]), "got 9"), (torch.tensor([-2, 1]), "got -2"),
                       (3.0, "whole-number"), (torch.tensor([1.0, 2.0]), "whole-number"),
                       (4, "never on: sequence 0 holds 3 positions, asked for 4"),
                       (torch.tensor([3, 6]), "never on: sequence 1 holds 5 positions, asked for 6")):
        with pytest.raises(ValueError, match=match):
            cache.rollback(bad)
        assert cache.lengths.tolist() == [3, 5]
    cache.rollback(3)
    assert cache.lengths.tolist() == [3, 3]
    cache.rollback(0)
    assert cache.lengths.tolist() == [0, 0]


@torch.no_grad()
def test_batched_rows_at_different_positions(tiny_checkpoint):
    """Each row of a batch decodes at its own position, as in continuous batching."""
    model, _ = llmstep.load(tiny_checkpoint, device="cpu", dtype=torch.float32)
    a = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(4))
    b = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(5))
    cache = model.new_cache(batch_size=2, max_len=16)
    model(torch.cat([a[:, :9], b[:, :9]]), cache=cache)
    cache.rollback(torch.tensor([9, 5]))  # row 1 forgets its last 4 tokens
    step = model(torch.cat([a[:, 9:10], b[:, 5:6]]), cache=cache)  # [2, 1, V] at positions 9 and 5
    torch.testing.assert_close(step[0, -1], model(a)[0, -1], atol=1e-5, rtol=0)
    torch.testing.assert_close(step[1, -1], model(b[:, :6])[0, -1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_half_precision_tracks_float32(tiny_checkpoint, dtype):
    model32, _ = llmstep.load(tiny_checkpoint, device="cpu", dtype=torch.float32)
    model16, _ = llmstep.load(tiny_checkpoint, device="cpu", dtype=dtype)
    assert model16.dtype == dtype
    tokens = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(6))
    a, b = model32(tokens), model16(tokens).float()
    assert (a - b).abs().max() < 0.1 * a.abs().max()
    assert (greedy(a[0]) == greedy(b[0])).float().mean() > 0.8


def test_saved_checkpoint_reloads_in_transformers_identically(tiny_checkpoint, tmp_path):
    model, tok = llmstep.load(tiny_checkpoint, device="cpu", dtype=torch.float32)
    out = llmstep.save(model, tmp_path / "copy", tokenizer=tok, dtype=torch.float32, max_shard_bytes=60_000)
    assert (out / "model.safetensors.index.json").is_file()
    ref = LlamaForCausalLM.from_pretrained(out).eval()
    again, _ = llmstep.load(out, device="cpu")
    tokens = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(again(tokens), model(tokens), atol=0, rtol=0)
        torch.testing.assert_close(ref(tokens).logits, model(tokens), atol=1e-4, rtol=0)


@torch.no_grad()
def test_float64_logits_match_reference_to_rounding(hf_checkpoint):
    """In float64 the two implementations agree to ~1e-15: any real difference in the function shows."""
    path, _ = hf_checkpoint
    model, _ = llmstep.load(path, device="cpu", dtype="float64")
    ref = LlamaForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    tokens = torch.randint(0, 300, (2, 100), generator=torch.Generator().manual_seed(8))
    assert model.dtype == torch.float64
    torch.testing.assert_close(model(tokens), ref(tokens).logits, atol=1e-10, rtol=0)


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return cfg


@torch.no_grad()
def test_tied_config_with_its_own_lm_head_is_what_transformers_computes(tmp_path, tokenizer_file):
    """tie_word_embeddings=true, yet the checkpoint holds a different lm_head.weight: transformers keeps that
    head (ties only equal tensors), and so must llmstep; an equal copy is tied as usual."""

    make_checkpoint(tmp_path, tokenizer_file, tie_word_embeddings=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tokens = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(9))
    for head, tied in [(tensors["model.embed_tokens.weight"].clone(), True), (torch.randn(300, 64), False)]:
        save_file(tensors | {"lm_head.weight": head}, tmp_path / "model.safetensors", metadata={"format": "pt"})
        model, _ = llmstep.load(tmp_path, device="cpu", dtype=torch.float32)
        ref = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        torch.testing.assert_close(model(tokens), ref(tokens).logits, atol=1e-5, rtol=0)
        assert model.config.tie_embeddings == tied
        assert (model.output.weight is model.tok_embeddings.weight) == tied


@torch.no_grad()
def test_config_json_read_with_transformers_precedence(tmp_path, tokenizer_file):
    """rope_theta inside rope_scaling beats the top-level one, and hidden_act 'swish' is SiLU, as in transformers."""

    make_checkpoint(tmp_path, tokenizer_file, rope_parameters=LLAMA3_SCALING, legacy_config=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    _edit_config(tmp_path, rope_scaling=cfg["rope_scaling"] | {"rope_theta": 1000.0}, hidden_act="swish")
    model, _ = llmstep.load(tmp_path, device="cpu", dtype=torch.float32)
    ref = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert model.config.rope_theta == 1000.0
    tokens = torch.randint(0, 300, (1, 60), generator=torch.Generator().manual_seed(10))
    torch.testing.assert_close(model(tokens), ref(tokens).logits, atol=1e-5, rtol=0)


@torch.no_grad()
def test_float64_weights_load(tmp_path, tokenizer_file):

    ref = make_checkpoint(tmp_path, tokenizer_file)
    tensors = {k: v.double() for k, v in load_file(tmp_path / "model.safetensors").items()}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model, _ = llmstep.load(tmp_path, device="cpu", dtype=torch.float32)
    tokens = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(11))
    torch.testing.assert_close(model(tokens), ref(tokens).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_a_static_steps_attention_over_every_slot_is_attention_over_the_written_ones(dtype, tol):
    """A static step (the compiled one: fixed shapes) attends over every cache slot with the unwritten ones masked;
    an eager step reads the written slots only. The same function: query heads folded onto their KV head, keys
    past each query's position hidden, whatever the hidden slots hold."""
    from llmstep.core.attention import causal_mask, sdpa

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 3, 16, generator=g).to(dtype)  # 6 query heads over 2 KV heads, 3 new tokens
    k, v = (torch.randn(1, 2, 10, 16, generator=g).to(dtype) for _ in range(2))  # 10 cache slots
    positions = torch.tensor([[4, 5, 6]])  # slots 7..9 unwritten: never seen
    written = sdpa(q, k[:, :, :7], v[:, :, :7], causal_mask(positions, torch.arange(7)))
    every = sdpa(q, k, v, causal_mask(positions, torch.arange(10)), static=True)
    assert every.dtype == dtype and every.shape == written.shape == (1, 6, 3, 16)
    torch.testing.assert_close(every.float(), written.float(), atol=tol, rtol=tol)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 7:], v2[:, :, 7:] = 1e4, -1e4  # what the hidden slots hold changes nothing
    torch.testing.assert_close(sdpa(q, k2, v2, causal_mask(positions, torch.arange(10)), static=True), every)


@pytest.mark.parametrize("tokens", [1, 6])  # 3 and 18 query rows a KV head: a decode step, a short chunk
def test_over_a_bf16_cache_a_static_steps_attention_is_the_float32_function_of_its_inputs(tokens):
    """Over a bf16 cache, the attention of a static step (SDPA's CPU kernel on the bf16 tensors as they lie) is
    the float32 function of the bf16 inputs: held to a float64 computation of it, to within one bf16 rounding
    of the output and one of the probabilities, which the kernel multiplies with V in bf16."""
    from llmstep.core.attention import sdpa

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 6, tokens, 64, generator=g).to(torch.bfloat16)  # [B, n_heads, T, hd]: 3 a KV head
    k, v = (torch.randn(1, 2, 40, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    visible = torch.rand(1, 1, tokens, 40, generator=g) < 0.7
    visible[..., 0] = True  # every row sees a key
    kk, vv = (t.double().repeat_interleave(3, dim=1) for t in (k, v))  # query head h reads KV head h // 3
    scores = (q.double() @ kk.transpose(-2, -1) * 64 ** -0.5).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [1, 6, T, 40]
    want = probs @ vv
    got = sdpa(q, k, v, visible, static=True)
    assert got.dtype == torch.bfloat16
    u = 2 ** -8  # bf16's unit roundoff: each probability and each output within u of its exact value
    bound = u * (probs @ vv.abs() + want.abs()) + 1e-6  # [1, 6, T, 64]: + float32's sums and exp
    assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() / bound).max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_in_half_precision_is_transformers_bit_for_bit(dtype):
    """The mean square in float32 whatever the dtype, then back, as LlamaRMSNorm does: the same bits. Taken in the
    half type itself (no upcast) a 2,048-wide mean of squares rounds otherwise, and this fails."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from llmstep.core.norm import RMSNorm

    g = torch.Generator().manual_seed(7)
    x = (torch.randn(4, 3, 2048, generator=g) * 3).to(dtype)
    ours, theirs = RMSNorm(2048, eps=1e-5), LlamaRMSNorm(2048, eps=1e-5)
    with torch.no_grad():
        w = torch.rand(2048, generator=g) + 0.5
        ours.weight.copy_(w)
        theirs.weight.copy_(w)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))


def test_the_memory_check_counts_a_tied_configs_own_lm_head_it_reads(tmp_path, tokenizer_file, monkeypatch):
    """The head is read (and kept where it differs): the bytes judged against free memory include it."""
    import llmstep.core.loader as loader
    from llmstep.core.cost import checkpoint_bytes

    make_checkpoint(tmp_path, tokenizer_file, tie_word_embeddings=True)
    tensors = load_file(tmp_path / "model.safetensors")
    judged = []
    monkeypatch.setattr(loader, "check_fits", lambda nbytes, device, what: judged.append(nbytes))
    llmstep.load(tmp_path, device="cpu", dtype=torch.float32)
    save_file(tensors | {"lm_head.weight": torch.randn(300, 64)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    model, _ = llmstep.load(tmp_path, device="cpu", dtype=torch.float32)
    tied = model.config.replace(tie_embeddings=True)
    assert judged == [checkpoint_bytes(tied, torch.float32, None), checkpoint_bytes(tied, torch.float32, None)
                      + 300 * 64 * 4]
