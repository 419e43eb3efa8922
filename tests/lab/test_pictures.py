"""The diagrams draw the package's numbers: stage bytes that sum to llmstep.core.cost's, shapes from the config,
a speculative run's own rounds, a batching run's own timeline."""

from __future__ import annotations

import matplotlib
import pytest
import torch

matplotlib.use("agg")
import matplotlib.pyplot as plt  # noqa: E402

from llmstep.core.config import LlamaConfig  # noqa: E402
from llmstep.core.cost import decode_step_cost, kv_bytes_per_token, model_bytes  # noqa: E402
from llmstep.engines.decoding import budget, cache_len  # noqa: E402
from llmstep.engines.kv_manager import KVCacheManager  # noqa: E402
from llmstep.engines.scheduler import Completion, Job, Scheduler  # noqa: E402
from llmstep.engines.speculative import Rounds  # noqa: E402
from llmstep.lab import pictures  # noqa: E402
from llmstep.lab.explore import model_configs  # noqa: E402

LLAMA8B = LlamaConfig.preset("llama-3.1-8b")


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts] + [ax.get_title() for ax in fig.axes]


@pytest.mark.parametrize("name", ["llama-3.1-8b", "shakespeare-target", "llama-3.2-1b"])
@pytest.mark.parametrize("context", [0, 511])  # 511: the shipped models' last step (a 512-token window)
def test_the_stages_add_up_to_the_cost_of_a_step(name, context):
    config = model_configs()[name]
    rows = pictures.step_stages(config, context, "bfloat16")
    cost = decode_step_cost(config, context, "bfloat16")
    assert sum(r.bytes for r in rows) == pytest.approx(cost.bytes, rel=1e-9)
    assert sum(r.flops for r in rows) == pytest.approx(cost.flops, rel=1e-9)
    assert [r.stage for r in rows][:3] == ["embedding", "rope tables", "attention norm"]
    assert rows[-1].stage == "sampling"
    by_stage = {r.stage: r for r in rows}
    assert by_stage["attention"].calls == config.n_layers and by_stage["rope"].calls == 2 * config.n_layers


def test_the_shapes_are_the_configs():
    rows = {r.stage: r for r in pictures.step_stages(LLAMA8B, 99)}
    assert rows["qkv projection"].outputs == "q [1, 32, 1, 128], k, v [1, 8, 1, 128]"
    assert rows["kv-cache write"].outputs == "K, V [1, 8, 100, 128]"  # 99 cached + this token
    assert rows["lm head"].outputs == "logits [1, 128256]"
    assert rows["mlp (SwiGLU)"].outputs == "[1, 1, 14336] -> x [1, 1, 4096]"
    with pytest.raises(ValueError, match="context"):
        pictures.step_stages(LLAMA8B, -1)


def test_the_decode_step_picture_shows_each_stages_bytes_and_the_total():
    fig = pictures.plot_decode_step(LLAMA8B, 1000, name="Llama-3.1-8B")
    shown = texts(fig)
    cost = decode_step_cost(LLAMA8B, 1000)
    assert any(pictures.si(cost.bytes, "B") + " read" in t for t in shown)
    for r in pictures.step_stages(LLAMA8B, 1000):
        assert any(t.startswith(r.stage) for t in shown)
        if r.bytes:
            assert pictures.si(r.bytes, "B") in shown
    small = texts(pictures.plot_decode_step(model_configs()["shakespeare-target"], 10, highlight=3))
    assert small != shown and any("x [1, 1, 384]" in t for t in small)


def test_the_gqa_picture_has_a_box_per_head_and_a_line_per_query_head():
    fig = pictures.plot_gqa(LLAMA8B)
    ax = fig.axes[0]
    assert len(ax.patches) == LLAMA8B.n_heads + LLAMA8B.n_kv_heads
    assert len(ax.lines) == LLAMA8B.n_heads
    assert pictures.si(kv_bytes_per_token(LLAMA8B), "B") in ax.get_title()
    # Query head h joins KV head h // n_rep: its line ends at that KV box's centre.
    for h, line in enumerate(ax.lines):
        assert line.get_xdata()[1] == pytest.approx((h // LLAMA8B.n_rep + 0.5) / LLAMA8B.n_kv_heads)


def test_the_cache_grows_a_tokens_worth_per_step_up_to_its_allocation():
    fig = pictures.plot_cache_growth(LLAMA8B, 100, 50, batch=2)
    ax = fig.axes[0]
    per_token = 2 * kv_bytes_per_token(LLAMA8B)
    written = ax.lines[0].get_ydata()
    # 50 new tokens: the prefill makes the first, 49 decode steps the rest, each writing the token before it (the
    # last is never fed back: generate()'s forwards are [100, 1, 1, ...], 49 of one token)
    assert written[0] == pytest.approx(100 * per_token / 1e6) and written[-1] == pytest.approx(149 * per_token / 1e6)
    assert len(written) == 50 and "100 prompt + 50 new" in ax.get_title()
    assert ax.lines[1].get_ydata()[0] == pytest.approx(cache_len(100, 50, LLAMA8B.max_seq_len) * per_token / 1e6)
    assert ax.lines[2].get_ydata()[0] == pytest.approx(model_bytes(LLAMA8B) / 1e6)
    with pytest.raises(ValueError, match="prompt_len"):
        pictures.plot_cache_growth(LLAMA8B, 0, 5)


def colours(fig) -> list[str]:
    return [matplotlib.colors.to_hex(p.get_facecolor()) for p in fig.axes[0].patches]


def test_a_speculative_round_shows_accepted_rejected_and_bonus_tokens():
    run = Rounds(k=3, proposed=[3, 3, 2, 3], accepted=[3, 1, 0, 2], produced=[4, 2, 1, 3])
    words = ["first"] + list("abcd") + list("ef") + ["g"] + list("hij")
    fig = pictures.plot_speculative_rounds(run, words)
    c = colours(fig)
    assert c.count("#6cc46c") == 6  # accepted: 3 + 1 + 0 + 2
    assert c.count("#e06060") == 3  # the first rejection of rounds 2, 3 and 4
    assert c.count("#cccccc") == 1 + 1  # proposals after a rejection
    assert c.count("#5b9bd5") == 1 and c.count("#f0a040") == 3  # bonus (all accepted) / resampled
    assert pictures.round_tokens(run, words) == [list("abcd"), list("ef"), ["g"], list("hij")]
    with pytest.raises(ValueError, match="emitted 11 tokens"):
        pictures.round_tokens(run, words[:-1])
    with pytest.raises(ValueError, match="no rounds"):
        pictures.plot_speculative_rounds(Rounds())


def test_a_real_speculative_run_is_drawn_from_its_record():
    import llmstep

    target, tok = llmstep.load("target", device="cpu", dtype=torch.float32)
    draft, _ = llmstep.load("draft", device="cpu", dtype=torch.float32)
    run = llmstep.speculative_generate(target, draft, tok, "ROMEO:", k=3, max_new_tokens=12, temperature=0, seed=0)
    fig = pictures.plot_speculative_rounds(run, [tok.decode([t]) for t in run.tokens])
    assert colours(fig).count("#6cc46c") == sum(run.accepted)
    assert len(fig.axes[0].patches) == sum(run.proposed) + run.rounds  # k proposals and its own token per round


def test_the_slots_picture_is_the_runs_timeline():
    jobs = [Job(Completion(id=i, prompt_ids=[1] * 3, arrival=i), budget(3, n, 48), set()) for i, n in
            enumerate((2, 5, 3, 1, 4))]
    s = Scheduler(jobs, 2, KVCacheManager(2, 48))
    s.dry_run(7)
    fig = pictures.plot_batching_slots(s.run)
    image = fig.axes[0].images[0].get_array()  # [slots, steps], masked where a slot is free
    expected = torch.tensor(s.run.timeline).T
    assert image.shape == tuple(expected.shape)
    assert (image.mask == (expected < 0).numpy()).all()
    assert (image.data[~image.mask] == expected[expected >= 0].numpy()).all()
    assert len([line for line in fig.axes[0].lines if line.get_marker() == "."]) == len(s.run.prefills)


def test_the_queue_under_the_slots_is_the_runs_record():
    jobs = [Job(Completion(id=i, prompt_ids=[1] * 3, arrival=0), budget(3, n, 48), set()) for i, n in
            enumerate((2, 5, 3, 1, 4))]
    s = Scheduler(jobs, 2, KVCacheManager(2, 48))
    s.dry_run(7)
    fig = pictures.plot_batching_slots(s.run, queue=True)
    slots, queue = fig.axes
    assert slots.images[0].get_array().shape == (2, s.run.steps)
    # step 0: 0 and 1 admitted, 3 wait; 1: 0 done, 3 wait; 2: 2 admitted, 2 wait; 3, 4: 1 and 2 run to their
    # ends; 5: 3 (done at its prefill) and 4 admitted, none wait; 6-8: 4 runs to its end
    assert list(queue.lines[0].get_ydata()) == s.run.queued == [3, 3, 2, 2, 2, 0, 0, 0, 0]
    assert len(pictures.plot_batching_slots(s.run).axes) == 1  # without queue=: the slots alone
    s.run.queued.clear()
    with pytest.raises(ValueError, match="queue"):
        pictures.plot_batching_slots(s.run, queue=True)


@pytest.mark.parametrize("n, text", [(999_400, "999 kB"), (999_500, "1 MB"), (999_950_000, "1 GB"), (1e12, "1 TB"),
                                     (1.5e9, "1.5 GB"), (0.5, "0.5 B"), (12_345, "12.3 kB")])
def test_si_chooses_the_prefix_after_rounding(n, text):
    assert pictures.si(n, "B") == text
