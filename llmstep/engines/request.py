"""One request, as vLLM's `SamplingParams`: what a caller asks for, one set of defaults, checked once.

Every engine takes a `Request`, and its keyword arguments are the request's fields (`FastDecoder.generate(ids, 20,
temperature=0)` is `.generate(Request(ids, 20, temperature=0))`; a keyword left at None keeps the request's value).
The defaults are fixed, not read from the checkpoint, so a request means the same in every engine and on every
model. `check_request` checks every field where the request enters and gives the `Checked` request an engine runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..core.checks import check_int, check_seed, is_int
from ..core.model import check_model
from ..core.parallel import is_sharded
from ..core.sampling import check_params
from ..core.tokens import Tokenizer
from .decoding import check_prompt_ids, encode_prompt, stop_id_set

__all__ = ["Request", "Checked", "as_request", "check_request", "check_arrival", "end_ids", "generator_seed",
           "sampling_key", "MAX_ARRIVAL_STEP"]

# The latest arrival step a batcher's run takes. Each engine step before it is recorded (a timeline row, shared by
# idle steps: ~24 bytes a step), so 10**6 steps cost ~24 MB and a few milliseconds; a workload whose requests come
# further apart is one with a lower rate than any batching measures.
MAX_ARRIVAL_STEP = 10**6


def check_arrival(arrival) -> None:
    """A request's arrival: an engine step from 0 to MAX_ARRIVAL_STEP (ValueError naming it)."""
    if not is_int(arrival) or arrival < 0:
        raise ValueError(f"arrival must be an engine step (an integer >= 0), got {arrival!r}")
    if arrival > MAX_ARRIVAL_STEP:
        raise ValueError(f"arrival step {arrival:,} is past the {MAX_ARRIVAL_STEP:,} steps a run records "
                         "(every step, idle ones too, is a row of its timeline): compress the idle time")


@dataclass
class Request:
    """What one request asks for. Every field but the prompt has the default every engine uses. An engine reads it
    once, when the request enters (`check_request`): changing it afterwards changes nothing already running."""

    prompt_ids: object  # token ids (a list, or a tensor [T] or [1, T]); text or chat messages for an engine with a
    #                     tokenizer (generate, stream, speculative_generate)
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None  # None: a fresh seed
    stop_ids: Iterable[int] | None = None  # None: the model's end tokens (`end_ids`); (): never stop early
    arrival: int = 0  # the engine step at which it joins a batcher's queue (the batchers only)


def as_request(prompt, **settings) -> Request:
    """A Request from an engine's arguments: `prompt` is a Request or its prompt; a setting given (not None) sets
    that field, one left at None keeps the request's (the default). seed=None and stop_ids=None are the defaults."""
    given = {name: value for name, value in settings.items() if value is not None}
    if isinstance(prompt, Request):
        return dataclasses.replace(prompt, **given)
    return Request(prompt, **given)


def end_ids(model: torch.nn.Module, tokenizer: Tokenizer | None = None) -> list[int]:
    """The model's end tokens: generation_config.json's eos_token_id, else config.json's; where the model declares
    none, the tokenizer's (when the engine has one). What a request's stop_ids=None stops at."""
    ids = (getattr(model, "generation_config", None) or {}).get("eos_token_id", model.config.eos_token_id)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return ids if ids or tokenizer is None else list(tokenizer.eos_ids)


@dataclass(frozen=True)
class Checked:
    """A request after `check_request`: what an engine runs."""

    ids: list[int]  # the prompt's token ids
    max_new_tokens: int
    sampling: tuple[float, int, float]  # temperature, top_k, top_p
    seed: int | None
    stops: frozenset[int]
    arrival: int = 0

    @property
    def greedy(self) -> bool:
        return self.sampling[0] == 0

    def generator(self, device: torch.device) -> torch.Generator:
        """This request's random numbers on the model's device: seeded, the same in every engine, drawn in the same
        order; None, a fresh seed."""
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(generator_seed(int(self.seed), g.device))
        return g


def generator_seed(seed: int, device: torch.device) -> int:
    """The seed a request's generator on `device` is given for `seed` (0 .. 2**64 - 1). torch's CPU generator (a
    Mersenne twister) keeps a seed's low 32 bits alone, so 5 and 5 + 2**32 would draw the same numbers: there a seed
    of 2**32 or more is mixed down to 32 bits (splitmix64's finaliser: every bit of it moves the result), and seeds
    below 2**32 are themselves. With 2**32 seeds a CPU generator can tell apart, two mixed seeds may still meet, by
    chance, not by a pattern. A CUDA generator (Philox) keeps all 64 bits: the seed as given."""
    if device.type != "cpu" or seed < 2**32:
        return seed
    mask = 2**64 - 1
    z = (seed ^ (seed >> 30)) * 0xBF58476D1CE4E5B9 & mask
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & mask
    z ^= z >> 31
    return (z ^ (z >> 32)) & 0xFFFFFFFF


def check_request(request: Request, model: torch.nn.Module, limit: int | None = None,
                  room: str = "the model's context", tokenizer: Tokenizer | None = None,
                  index: int | None = None) -> Checked:
    """Every field of `request` checked for `model` before any work: a ValueError naming the field (given an index,
    starting "request {index}: "). limit: the positions a sequence may fill (default the model's context; `room`
    names them). tokenizer: text and chat messages are encoded with it (else the prompt must be token ids)."""
    check_model(model)
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be a llmstep Tokenizer (llmstep.load returns (model, tokenizer)), got "
                        f"{type(tokenizer).__name__}")
    if tokenizer is not None and model.config.vocab_size > (known := tokenizer.decodable_size):
        raise ValueError(f"the model's vocabulary ({model.config.vocab_size:,} ids) is larger than its tokenizer's "
                         f"({known:,}): an id it samples past {known - 1:,} has no text; give the model's own "
                         "tokenizer (llmstep.load returns both), or set tokenizer.padded_vocab_size where the ids "
                         "past the tokenizer's are padding")
    r, vocab = request, model.config.vocab_size
    limit = model.config.max_seq_len if limit is None else limit
    try:
        if not isinstance(r, Request):
            raise ValueError(f"a request must be a llmstep Request, got {type(r).__name__}")
        check_params(r.temperature, r.top_k, r.top_p)
        check_int(r.max_new_tokens, "max_new_tokens")
        check_seed(r.seed)
        if r.seed is None and r.temperature != 0 and is_sharded(model):
            raise ValueError("a tensor-parallel model's ranks draw the same tokens only with one seed: give the "
                             "request a seed (llmstep.core.parallel.agree_seed(None) draws one for every rank)")
        check_arrival(r.arrival)
        stops = stop_id_set(end_ids(model, tokenizer) if r.stop_ids is None else r.stop_ids, vocab)
        if tokenizer is not None:
            ids = encode_prompt(tokenizer, r.prompt_ids, limit, vocab)
        else:
            ids = check_prompt_ids(r.prompt_ids, vocab, limit, room=room)
    except ValueError as e:
        if index is None:
            raise
        raise ValueError(f"request {index}: {e}") from None
    return Checked(ids, int(r.max_new_tokens), sampling_key(r.temperature, r.top_k, r.top_p), r.seed,
                   frozenset(stops), int(r.arrival))


def sampling_key(temperature: float, top_k: int | None, top_p: float) -> tuple[float, int, float]:
    """Checked sampling settings as plain numbers, (temperature, top_k, top_p): greedy is (0.0, 0, 1.0) whatever
    top_k and top_p it was given (they change nothing at temperature 0), so an engine keyed by the setting (a compiled
    step each) makes one greedy step, not one per pair."""
    if temperature == 0:
        return 0.0, 0, 1.0
    return float(temperature), int(top_k or 0), float(top_p)
