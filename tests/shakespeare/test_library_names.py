"""The shakespeare layer names its own arguments and the shipped models by the names the checkpoint reader knows."""

from __future__ import annotations

import inspect

import pytest

from llmstep.core.checkpoint import SHIPPED
from llmstep.core.tokens import BOS
from llmstep.shakespeare import data, evaluate, train


def test_evaluate_defaults_to_the_shipped_names_and_resolves_them():
    assert inspect.signature(evaluate.evaluate_models).parameters["models"].default == tuple(SHIPPED)
    score = evaluate.evaluate_model("draft", "val", max_tokens=64, batch_size=1)
    assert score.name == "shakespeare-draft" and score.tokens > 0


def test_a_missing_model_is_refused_before_any_scoring(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        evaluate.evaluate_models([tmp_path / "nowhere"], splits=("val",), baseline=False)


def test_a_training_document_ends_with_the_id_generation_stops_at():
    """The stream the models were trained on ends each work with the token the shipped tokenizer (and so every
    engine's default stop rule) takes as the end: a model that learned where works end stops there."""
    from tokenizers import Tokenizer as RawTokenizer

    from llmstep.core.tokens import Tokenizer

    text = data.DOC_SEPARATOR.join(["HAMLET\nTo be, or not to be", "SONNET\nShall I compare thee"])
    raw = RawTokenizer.from_file(str(data.TOKENIZER_PATH))
    ids = data.encode_split(raw, text)
    end = Tokenizer.from_file(data.TOKENIZER_PATH).eos_ids[0]
    bos = raw.token_to_id(BOS)
    starts = [i for i, t in enumerate(ids) if t == bos]
    assert starts[0] == 0 and len(starts) == 2  # two works
    assert [ids[i - 1] for i in starts[1:]] + [ids[-1]] == [end, end]  # each ends with the end id
    assert ids.count(end) == 2


def test_train_errors_name_the_library_argument_not_the_flag(tmp_path):
    cfg = train.train_config("tiny", steps=1)
    with pytest.raises(FileNotFoundError, match=r"^resume: no checkpoint"):
        train.train(cfg, tmp_path / "fresh", {}, resume=True, quiet=True)
    with pytest.raises(FileNotFoundError) as e:
        train.train(train.train_config("tiny", steps=1, init_from=str(tmp_path / "none")), tmp_path / "run", {},
                    quiet=True)
    assert "--" not in str(e.value)
