"""The shakespeare layer names its own arguments and the shipped models by the names the checkpoint reader knows."""

from __future__ import annotations

import inspect

import pytest

from llmstep.core.checkpoint import SHIPPED
from llmstep.core.tokens import EOS_CANDIDATES
from llmstep.shakespeare import data, evaluate, train


def test_evaluate_defaults_to_the_shipped_names_and_resolves_them():
    assert inspect.signature(evaluate.evaluate_models).parameters["models"].default == tuple(SHIPPED)
    score = evaluate.evaluate_model("draft", "val", max_tokens=64, batch_size=1)
    assert score.name == "shakespeare-draft" and score.tokens > 0


def test_a_missing_model_is_refused_before_any_scoring(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        evaluate.evaluate_models([tmp_path / "nowhere"], splits=("val",), baseline=False)


def test_a_document_ends_with_the_tokenizers_first_eos_candidate():
    assert data.EOS == EOS_CANDIDATES[0]


def test_train_errors_name_the_library_argument_not_the_flag(tmp_path):
    cfg = train.train_config("tiny", steps=1)
    with pytest.raises(FileNotFoundError, match=r"^resume: no checkpoint"):
        train.train(cfg, tmp_path / "fresh", {}, resume=True, quiet=True)
    with pytest.raises(FileNotFoundError) as e:
        train.train(train.train_config("tiny", steps=1, init_from=str(tmp_path / "none")), tmp_path / "run", {},
                    quiet=True)
    assert "--" not in str(e.value)
