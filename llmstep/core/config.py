"""The shape of a LLaMA-3 model: one dataclass, read from a Hugging Face config.json or a preset.

Names follow Meta's reference code (dim, n_layers, n_heads, n_kv_heads, hidden_dim); `from_hf` maps
the Hugging Face names (hidden_size, num_hidden_layers, ...) onto them.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .checks import is_finite_number, is_int, is_number

__all__ = ["LlamaConfig", "RopeScaling", "ConfigError", "PRESETS", "check_generation_config", "parse_json",
           "read_json_object", "read_config_json",
           "MAX_LAYERS", "MAX_CONTEXT", "MAX_VOCAB", "MAX_WIDTH", "TORCH_DTYPES", "sampling_defaults"]

# Sanity bounds, checked before anything is built from a config (a per-layer table, a cache). Far above every
# published Llama (405B: 126 layers, dim 16384, hidden 53248, context 131072, vocabulary 128256); they only stop
# a typo or a hostile config.json from asking for a million layers or a 10^12-token cache.
MAX_LAYERS = 1024
MAX_CONTEXT = 2**24  # 16.8M positions
MAX_VOCAB = 2**24
MAX_WIDTH = 2**20  # dim, hidden_dim, and heads x head_dim
TORCH_DTYPES = ("bfloat16", "float16", "float32", "float64")  # config.json's torch_dtype: weights' float type


class ConfigError(ValueError):
    """A config that cannot describe a LLaMA-3 model; the message names the field."""


def parse_json(text: str | bytes, where: str, error: type[Exception] = ValueError):
    """JSON text from a file or a flag -> its value; `error` naming `where` for text that is not JSON, or that
    nests deeper than Python's parser recurses (a hostile '[[[[...' would otherwise be a RecursionError)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{where} is not valid JSON: {e}") from None
    except RecursionError:
        raise error(f"{where} nests its JSON too deeply to be read (thousands of levels): not a file llmstep "
                    "wrote or reads") from None


def read_json_object(path: Path, error: type[Exception] = ValueError) -> dict:
    """The JSON object in `path` (config.json, generation_config.json); `error` naming the file otherwise."""
    try:
        data = parse_json(path.read_text(encoding="utf-8"), str(path), error)
    except UnicodeDecodeError as e:
        raise error(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); JSON files must be UTF-8") from None
    if not isinstance(data, dict):
        raise error(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_config_json(path: str | os.PathLike) -> tuple[dict, Path]:
    """(the JSON object, its file) of a config.json, or of the directory holding one: parsed, not yet checked."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_dir():
        raise ConfigError(f"{path} is a directory, not a config.json file")
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    return read_json_object(path, ConfigError), path


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's `llama3` RoPE frequency scaling (meta-llama/Llama-3.1-8B config.json)."""

    factor: float = 8.0  # low frequencies are slowed down by this much
    low_freq_factor: float = 1.0  # wavelengths above original_max / low_freq_factor are fully scaled
    high_freq_factor: float = 4.0  # wavelengths below original_max / high_freq_factor are untouched
    original_max_position_embeddings: int = 8192  # Llama 3's pre-training context

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if not is_finite_number(value):
                raise ConfigError(f"rope_scaling.{name} must be a finite number, got {value!r}")
        if not self.factor >= 1.0:
            raise ConfigError(f"rope_scaling.factor must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if not 0 < self.original_max_position_embeddings <= MAX_CONTEXT:
            raise ConfigError(f"rope_scaling.original_max_position_embeddings must be in 1..{MAX_CONTEXT}, "
                              f"got {self.original_max_position_embeddings}")


# LlamaConfig's field -> the config.json key it is read from (LlamaConfig.from_hf), for errors that name the file's
_HF_NAMES = {"dim": "hidden_size", "hidden_dim": "intermediate_size", "n_layers": "num_hidden_layers",
             "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
             "max_seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps"}


def _hf_name(match: re.Match) -> str:
    """A field's name as config.json spells it; a quoted value (a string the file gave) as it is."""
    return _HF_NAMES[match.group(1)] if match.group(1) else match.group(0)


@dataclass
class LlamaConfig:
    vocab_size: int = 128256  # Llama 3: 128,000 BPE tokens + 256 special tokens
    dim: int = 4096  # width of the residual stream (HF: hidden_size)
    n_layers: int = 32
    n_heads: int = 32  # query heads
    n_kv_heads: int = 8  # key/value heads; n_heads // n_kv_heads query heads share one (GQA)
    hidden_dim: int = 14336  # SwiGLU inner width (HF: intermediate_size)
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0  # Llama 3 raised RoPE's base from Llama 2's 10,000
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 8192  # HF: max_position_embeddings
    tie_embeddings: bool = False  # Llama 3.2 1B/3B reuse the embedding matrix as the LM head
    head_dim: int | None = None  # None: dim // n_heads (true for every Llama 3 model)
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str = "bfloat16"  # the dtype the weights were published in

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if isinstance(self.eos_token_id, int) or self.eos_token_id is None:  # 0 is a token id too
            self.eos_token_id = [] if self.eos_token_id is None else [self.eos_token_id]
        if not isinstance(self.eos_token_id, list | tuple):
            raise ConfigError(f"eos_token_id must be an integer or a list of them, got {self.eos_token_id!r}")
        self.eos_token_id = list(self.eos_token_id)
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "max_seq_len"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        # Bounds first: nothing below (nor any caller) builds a per-layer structure from an absurd count.
        bounds = {"n_layers": MAX_LAYERS, "max_seq_len": MAX_CONTEXT, "vocab_size": MAX_VOCAB, "dim": MAX_WIDTH,
                  "hidden_dim": MAX_WIDTH, "n_heads": MAX_WIDTH}
        for name, bound in bounds.items():
            if getattr(self, name) > bound:
                raise ConfigError(f"{name} is {getattr(self, name):,}, above llmstep's bound of {bound:,} "
                                  "(far beyond any published Llama): a mistake in the config?")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}): "
                "each key/value head serves a whole group of query heads"
            )
        if self.head_dim is not None and not is_int(self.head_dim):
            raise ConfigError(f"head_dim must be an integer, got {self.head_dim!r}")
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ConfigError(
                    f"dim ({self.dim}) is not divisible by n_heads ({self.n_heads}); "
                    "give head_dim explicitly or fix the sizes"
                )
            self.head_dim = self.dim // self.n_heads
        if self.head_dim <= 0 or self.head_dim % 2 or self.head_dim * self.n_heads > MAX_WIDTH:
            raise ConfigError(f"head_dim must be a positive even number (RoPE rotates pairs) with n_heads x head_dim "
                              f"<= {MAX_WIDTH:,}, got {self.head_dim}")
        for name, value in (("norm_eps", self.norm_eps), ("rope_theta", self.rope_theta)):
            if not is_finite_number(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
        if not 0 < self.norm_eps < 1:  # added to a mean square before its root: 1e-5 or 1e-6 in every Llama
            raise ConfigError(f"norm_eps must be between 0 and 1, got {self.norm_eps}")
        if not self.rope_theta > 1:  # theta^(-2i/d) must fall from 1 towards 0; Llama 3 uses 500000
            raise ConfigError(f"rope_theta must be greater than 1, got {self.rope_theta}")
        if self.torch_dtype not in TORCH_DTYPES:  # else a GPU would load it in a dtype nobody chose
            raise ConfigError(f"torch_dtype must be one of {', '.join(TORCH_DTYPES)} (the float types llmstep loads "
                              f"weights in), got {self.torch_dtype!r}")
        if None in self.eos_token_id:  # null alone means no end token; inside a list it is no token id
            raise ConfigError(f"eos_token_id lists null: {self.eos_token_id!r}; list token ids only")
        for name, tok in [("bos_token_id", self.bos_token_id)] + [("eos_token_id", t) for t in self.eos_token_id]:
            if tok is not None and not is_int(tok):
                raise ConfigError(f"{name} must be an integer token id, got {tok!r}")
            if tok is not None and not 0 <= tok < self.vocab_size:
                raise ConfigError(f"{name} {tok} is outside the vocabulary (size {self.vocab_size})")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def n_rep(self) -> int:
        """Query heads per key/value head: 1 is MHA, n_heads is MQA, in between is GQA."""
        return self.n_heads // self.n_kv_heads

    # ---- Hugging Face config.json ----------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: str | os.PathLike | dict, where: str = "config") -> LlamaConfig:
        """Read a Hugging Face Llama config: a dict (its errors naming `where`, the file it came from), a
        config.json file, or a directory holding one.

        Accepts both the published Llama 3.x files (top-level `rope_theta` and `rope_scaling`) and the
        newer `rope_parameters` form.
        """
        if not isinstance(source, dict):
            source, path = read_config_json(source)
            where = str(path)
        hf = dict(source)
        model_type = hf.get("model_type", "llama")
        if model_type != "llama":
            raise ConfigError(f"{where}: model_type is {model_type!r}; llmstep implements 'llama' only")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag) not in (None, False):
                raise ConfigError(f"{where}: {flag}={hf[flag]!r}: biases are not part of LLaMA 3 and are not supported")
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # transformers maps both names to the same SiLU
            raise ConfigError(f"{where}: hidden_act is {act!r}; LLaMA 3's SwiGLU uses 'silu'")
        required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]
        missing = [k for k in required if k not in hf]
        if missing:
            raise ConfigError(f"{where}: missing {', '.join(missing)}")

        # transformers' precedence: a legacy rope_scaling dict replaces rope_parameters; inside either, rope_theta
        # beats the top-level one.
        field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
        rope = hf.get(field) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{where}: {field} must be an object, got {rope!r}")
        theta = _number(rope.get("rope_theta", hf.get("rope_theta", 10000.0)), "rope_theta", where)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
        if partial not in (None, 1, 1.0):
            raise ConfigError(f"{where}: partial_rotary_factor={partial!r} is not supported: "
                              "LLaMA 3 rotates the whole head")
        if rope_type == "llama3":
            keys = ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
            absent = [k for k in keys if k not in rope]
            if absent:
                raise ConfigError(f"{where}: llama3 rope scaling ({field}) is missing {', '.join(absent)}")
            values = {k: _number(rope[k], f"{field}.{k}", where) for k in keys[:3]}
            original = rope["original_max_position_embeddings"]
            if not is_int(original):
                raise ConfigError(f"{where}: {field}.original_max_position_embeddings must be an integer, "
                                  f"got {original!r}")
            try:
                rope_scaling = RopeScaling(**values, original_max_position_embeddings=original)
            except ConfigError as e:
                raise ConfigError(f"{where}: {str(e).replace('rope_scaling', field)}") from None
        elif rope_type == "default":
            rope_scaling = None
        else:
            raise ConfigError(f"{where}: {field} has rope type {rope_type!r}, which is not supported "
                              "(only 'default' and 'llama3')")
        tie = hf.get("tie_word_embeddings")
        if tie is not None and not isinstance(tie, bool):
            raise ConfigError(f"{where}: tie_word_embeddings must be true or false, got {tie!r}")
        n_kv_heads = hf.get("num_key_value_heads")
        norm_eps = _number(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps", where)

        try:
            return cls(
                vocab_size=hf["vocab_size"],
                dim=hf["hidden_size"],
                n_layers=hf["num_hidden_layers"],
                n_heads=hf["num_attention_heads"],
                n_kv_heads=hf["num_attention_heads"] if n_kv_heads is None else n_kv_heads,
                hidden_dim=hf["intermediate_size"],
                norm_eps=norm_eps,
                rope_theta=theta,
                rope_scaling=rope_scaling,
                max_seq_len=hf.get("max_position_embeddings", 2048),
                tie_embeddings=bool(tie),
                head_dim=hf.get("head_dim"),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=hf.get("eos_token_id"),
                torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"),
            )
        except ConfigError as e:  # named as the file names them: intermediate_size, not hidden_dim
            raise ConfigError(f"{where}: " + re.sub(r"'[^']*'|\"[^\"]*\"|\b(" + "|".join(_HF_NAMES) + r")\b",
                                                    _hf_name, str(e))) from None

    def to_hf(self) -> dict:
        """The config.json that transformers' LlamaForCausalLM reads (published Llama 3.x form)."""
        hf = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "intermediate_size": self.hidden_dim,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_seq_len,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else (self.eos_token_id or None),
            "torch_dtype": self.torch_dtype,
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = {"rope_type": "llama3", **asdict(self.rope_scaling)}
        return hf

    # ---- presets ---------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides) -> LlamaConfig:
        """Real Llama 3.x shapes (from meta-llama's config.json files), for arithmetic and random-weight runs."""
        key = name.lower()
        if key not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; choose one of {', '.join(sorted(PRESETS))}")
        return replace(PRESETS[key], **overrides)

    def replace(self, **changes) -> LlamaConfig:
        return replace(self, **changes)


def _number(value, name: str, where: str) -> float:
    """A config.json number as a finite float, or a ConfigError naming the field and the file."""
    if not is_number(value):
        raise ConfigError(f"{where}: {name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{where}: {name} must be a finite number, got {value!r}")
    return float(value)


# generation_config.json fields llmstep reads, and what each must hold (transformers' GenerationConfig names).
_GENERATION_FIELDS = {
    "temperature": (lambda v: v >= 0, "a number >= 0"),
    "top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    "max_length": (lambda v: isinstance(v, int) and v > 0, "a positive integer"),
    "max_new_tokens": (lambda v: isinstance(v, int) and v > 0, "a positive integer"),
    "repetition_penalty": (lambda v: v > 0, "a number > 0"),
}


def check_generation_config(gen: dict, where: str, vocab_size: int | None = None) -> dict:
    """Refuse a generation_config.json field of the wrong kind ("temperature": "hot"), naming the file and field;
    given the model's vocab_size, a bos or eos id outside it too (it could never be made, or never stop a run)."""
    for name in ("bos_token_id", "eos_token_id") if vocab_size is not None else ():
        ids = gen.get(name)
        for i in ids if isinstance(ids, list) else [] if ids is None else [ids]:
            if not is_int(i) or not 0 <= i < vocab_size:
                raise ConfigError(f"{where}: {name} {i!r} is not a token id of the model's vocabulary "
                                  f"(0..{vocab_size - 1})")
    for name, (ok, what) in _GENERATION_FIELDS.items():
        value = gen.get(name)
        if value is None:
            continue
        if not is_finite_number(value) or not ok(value):
            raise ConfigError(f"{where}: {name} must be {what}, got {value!r}")
    if "do_sample" in gen and not isinstance(gen["do_sample"], bool):
        raise ConfigError(f"{where}: do_sample must be true or false, got {gen['do_sample']!r}")
    return gen


def sampling_defaults(gen: dict | None) -> dict:
    """A generation_config as the sampling defaults it means, by transformers' rule: it samples only where it says
    do_sample: true (GenerationConfig's default is false), so a file that gives temperature, top_k or top_p without
    do_sample: true is greedy, temperature 0 whatever temperature it gives. A file that names none of them (bos/eos
    ids only) leaves the sampling to the caller's defaults."""
    gen = dict(gen or {})
    names_sampling = any(gen.get(key) is not None for key in ("temperature", "top_k", "top_p"))
    greedy = gen.get("do_sample") is False or (names_sampling and gen.get("do_sample") is not True)
    return gen | {"temperature": 0.0} if greedy else gen


_LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)
_LLAMA32_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)
_LLAMA3_IDS = dict(bos_token_id=128000, eos_token_id=[128001])

PRESETS: dict[str, LlamaConfig] = {
    "llama-3-8b": LlamaConfig(**_LLAMA3_IDS),
    "llama-3-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, hidden_dim=28672, **_LLAMA3_IDS),
    "llama-3.1-8b": LlamaConfig(rope_scaling=_LLAMA31_SCALING, max_seq_len=131072, **_LLAMA3_IDS),
    "llama-3.1-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, hidden_dim=28672,
                                 rope_scaling=_LLAMA31_SCALING, max_seq_len=131072, **_LLAMA3_IDS),
    "llama-3.1-405b": LlamaConfig(dim=16384, n_layers=126, n_heads=128, hidden_dim=53248,
                                  rope_scaling=_LLAMA31_SCALING, max_seq_len=131072, **_LLAMA3_IDS),
    "llama-3.2-1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, hidden_dim=8192, tie_embeddings=True,
                                rope_scaling=_LLAMA32_SCALING, max_seq_len=131072, **_LLAMA3_IDS),
    "llama-3.2-3b": LlamaConfig(dim=3072, n_layers=28, n_heads=24, hidden_dim=8192, tie_embeddings=True,
                                rope_scaling=_LLAMA32_SCALING, max_seq_len=131072, **_LLAMA3_IDS),
}
