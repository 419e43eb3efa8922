"""Train a small LLaMA-3 on the Shakespeare corpus: how the shipped default models were made.

    llmstep train --preset target --out runs/target      # then data/models/... via --export
    llmstep train --preset tiny --steps 20 --out /tmp/tiny

    llmstep train --preset draft --init-from draft --teacher target --out runs/distil   # distillation

A plain, readable loop: random windows of the train split, AdamW, linear warm-up then cosine decay,
gradient clipping, bf16 autocast on CUDA (fp32 on the CPU), a validation loss every `eval_every`
steps, a checkpoint every `save_every` steps (safetensors, no pickle: llmstep.shakespeare.train_state) that
`--resume` continues from exactly (a run without --resume refuses a folder that holds one). At the end the
model is written in Hugging Face layout (bf16 safetensors, config.json, generation_config.json,
tokenizer.json) with a model card and the training log.

Determinism: the weights come from `seed`, and the batch of step s is drawn from a generator seeded
with (seed, s), so an interrupted and resumed run sees the same batches as an uninterrupted one and,
on the CPU, ends with bit-identical weights.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..core.checkpoint import check_save_folder, load_model, read_config, save
from ..core.checks import is_finite_number, is_int
from ..core.config import ConfigError, LlamaConfig
from ..core.cost import check_fits, training_bytes
from ..core.device import native_bf16, resolve_device
from ..core.files import atomic_write_bytes, atomic_write_text
from ..core.model import Llama
from ..core.tokens import Tokenizer as LlamaTokenizer
from ..lab import runinfo
from . import data
from .evaluate import evaluate_model, model_nll, split_ids
from .train_state import CHECKPOINT as CHECKPOINT  # the run folder's checkpoint: llmstep.cli names it
from .train_state import LOG, check_run_folder, first_nonfinite, open_log, resume_state, save_train_state

# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------

# Model shapes. All are LLaMA 3 with GQA (n_kv_heads < n_heads), rope_theta 500000 and tied embeddings
# (as Llama 3.2 1B/3B). Sizes were chosen so that each trains on a 2-core CPU in under an hour (each model card in
# data/models/ records its run).
SHAPES: dict[str, dict] = {
    "target": dict(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, hidden_dim=1024, max_seq_len=512),  # 12.6M
    "draft": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=1, hidden_dim=384, max_seq_len=512),  # 1.4M
    "tiny": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=64),  # for tests
}

SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "max_seq_len")

# Training defaults per preset: 2048 tokens per step for the target (small batches, many updates: the
# CPU budget allows ~1.5 epochs), 4096 for the cheaper draft.
RECIPES: dict[str, dict] = {
    "target": dict(steps=900, batch_size=4, seq_len=512, lr=1e-3, warmup_steps=50),
    "draft": dict(steps=900, batch_size=8, seq_len=512, lr=2e-3, warmup_steps=50),
    "tiny": dict(steps=20, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=4),
}


@dataclass
class TrainConfig:
    preset: str = "target"
    steps: int = 900  # optimizer steps in the whole run (the schedule's length)
    batch_size: int = 4
    seq_len: int = 512  # tokens per training window (<= max_seq_len)
    lr: float = 1e-3  # peak learning rate, reached after warmup_steps
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.1  # on matrices only, not on norm gains
    beta1: float = 0.9
    beta2: float = 0.95  # the LLaMA papers' AdamW betas
    grad_clip: float = 1.0  # max global grad norm
    eval_every: int = 100
    eval_tokens: int = 32768  # validation tokens scored at each eval (the val play is ~32k)
    save_every: int = 100
    seed: int = 1337
    init_from: str = ""  # start from this checkpoint's weights (same shape) instead of the random init
    teacher: str = ""  # distil: match this checkpoint's next-token distribution instead of the one-hot target
    corpus: str = str(data.CORPUS_DIR)
    tokenizer: str = str(data.TOKENIZER_PATH)
    device: str = "auto"


# AdamW's settings as check_train_config and `llmstep train`'s flags bound them: name -> (range, test). The maxima are
# far past any that trains (lr 1e-4 .. 1e-2, decay 0.1) and far below float32's max, where AdamW's step overflows.
LR_MAX = WEIGHT_DECAY_MAX = 10.0
BETA = ("[0, 1)", lambda v: 0 <= v < 1)  # a beta of 1 never forgets (torch refuses it, naming no flag)
BOUNDS = {"lr": (f"[0, {LR_MAX:g}]", lambda v: 0 <= v <= LR_MAX), "beta1": BETA, "beta2": BETA,
          "weight_decay": (f"[0, {WEIGHT_DECAY_MAX:g}]", lambda v: 0 <= v <= WEIGHT_DECAY_MAX)}


# --------------------------------------------------------------------------------------------------
# Pieces of the loop
# --------------------------------------------------------------------------------------------------


def model_config(preset: str, tokenizer, **overrides) -> LlamaConfig:
    shape = SHAPES[preset] | {k: v for k, v in overrides.items() if v is not None}
    try:
        return LlamaConfig(vocab_size=tokenizer.get_vocab_size(), rope_theta=500000.0,  # Llama 3's RoPE base
                           tie_embeddings=True, bos_token_id=tokenizer.token_to_id(data.BOS),
                           eos_token_id=[tokenizer.token_to_id(data.EOS)],  # works end with <|end_of_text|>
                           **shape)
    except ConfigError as e:  # LlamaConfig's rule on the heads' width, in the flags training has (no --head-dim)
        if "head_dim" not in str(e):
            raise
        raise ConfigError(f"{str(e).replace('; give head_dim explicitly or fix the sizes', '')}: each head is dim / "
                          "n_heads wide, an even width (RoPE rotates pairs); give another --dim or --n-heads") from None


def init_weights(model: Llama, seed: int) -> None:
    """GPT-2-style init: N(0, 0.02) for matrices, scaled by 1/sqrt(2 n_layers) on the two projections
    that write into the residual stream (wo, w2), so the stream's variance does not grow with depth.
    RMSNorm gains stay at 1."""
    gen = torch.Generator().manual_seed(seed)
    std = 0.02
    for name, p in model.named_parameters():
        if p.dim() == 2:
            residual = name.endswith(("wo.weight", "w2.weight"))
            scale = 1 / math.sqrt(2 * model.config.n_layers) if residual else 1.0
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * std * scale)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr over warmup_steps, then cosine decay to lr * min_lr_ratio at cfg.steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def get_batch(ids: torch.Tensor, step: int, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the train stream for this step: inputs x and targets y, both [B, T]."""
    # a function of (seed, step) only, in manual_seed's range for every seed up to 2**64 - 1; below 2**44 the
    # modulo changes nothing, so the shipped models' batches (small seeds) are those they were trained on
    gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) % 2**64)
    starts = torch.randint(0, len(ids) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)  # [B]
    chunk = torch.stack([ids[s : s + cfg.seq_len + 1] for s in starts.tolist()])  # [B, T+1]
    return chunk[:, :-1], chunk[:, 1:]


def make_optimizer(model: Llama, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]  # weight matrices (and the tied embedding)
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # RMSNorm gains
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=False)


def pick_device(name: str) -> torch.device:
    """"auto": CUDA when present, else the CPU (MPS is not used for training)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_device(name)


def autocast(device: torch.device):
    """bf16 autocast where the GPU does bf16 in hardware (compute capability 8.0 on); plain fp32 elsewhere (a T4 or
    V100 only emulates bf16, slower than fp32)."""
    if native_bf16(device):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def hardware(device: torch.device) -> str:
    """The machine and torch version, one line for the model card (from llmstep.lab.runinfo)."""
    info = runinfo.machine(device)
    kind = "CUDA" if device.type == "cuda" else f"CPU, {info['torch_threads']} torch threads"
    return f"{info.get('device_name', info['cpu'])} ({kind}), torch {runinfo.versions()['torch']}"


@torch.no_grad()
def val_loss(model: Llama, val_ids: list[int], cfg: TrainConfig, device: torch.device) -> float:
    """Mean NLL per token on the first eval_tokens tokens of the val split, windows of seq_len."""
    with autocast(device):
        nll, n = model_nll(model, val_ids[: cfg.eval_tokens], cfg.seq_len, batch_size=cfg.batch_size)
    return nll / n


# --------------------------------------------------------------------------------------------------
# Checkpoints and export
# --------------------------------------------------------------------------------------------------


def model_card(info: dict) -> str:
    c = info["config"]
    n_params = info["n_params"]
    return f"""# {info['name']}

A {n_params / 1e6:.2f}M-parameter LLaMA-3 decoder trained from scratch on Shakespeare, shipped with
llmstep as a default model ({info['role']}). Weights are bfloat16 safetensors in Hugging Face layout:
`llmstep.load("{info['path']}")` reads them, and so does `transformers.LlamaForCausalLM`.

## Architecture

| field | value |
|---|---|
| dim (hidden_size) | {c['dim']} |
| layers | {c['n_layers']} |
| query heads / key-value heads | {c['n_heads']} / {c['n_kv_heads']} (GQA, {info['n_rep']} per KV head) |
| head_dim | {c['head_dim']} |
| SwiGLU hidden_dim | {c['hidden_dim']} |
| vocabulary | {c['vocab_size']} (byte-level BPE, `tokenizer.json`, shared by both default models) |
| context (max_seq_len) | {c['max_seq_len']} |
| RoPE theta | {c['rope_theta']:g}, no scaling |
| tied embeddings | {c['tie_embeddings']} |
| parameters | {n_params:,} |

## Training

- Data: `data/corpus/train.txt.gz`, {info['train_tokens']:,} tokens: 40 works of Shakespeare, with
  {', '.join(data.VAL_WORKS)} (val) and {', '.join(data.TEST_WORKS)} (test) held out; see `data/README.md`.
- Command: `{info['command']}`
- Steps: {info['steps']:,} of {info['batch_size']} x {info['seq_len']} tokens; tokens seen:
  {info['tokens_seen']:,} ({info['tokens_seen'] / info['train_tokens']:.1f} epochs).
- Optimizer: AdamW, betas {info['betas']}, weight decay {info['weight_decay']}, peak lr {info['lr']:g}
  after {info['warmup_steps']} linear warm-up steps, cosine decay to {info['lr'] * info['min_lr_ratio']:g},
  gradient clipping at {info['grad_clip']}, seed {info['seed']}; {info['precision']}.
- Wall time: {info['wall_seconds'] / 60:.1f} minutes of training on {info['hardware']}
  (a machine shared with other jobs; validation and checkpoints not counted).
- Final validation loss, fp32 weights, first {info['eval_tokens']:,} val tokens in windows of
  {info['seq_len']}: {info['final_val_loss']:.4f} nats/token (perplexity {math.exp(info['final_val_loss']):.2f}).
- Held-out perplexity of these bf16 weights on the whole val play, windows of {c['max_seq_len']}:
  {info['export_val_ppl']:.2f}.

The full log is `train.log`.

## Evaluation

<!-- eval:start -->
Filled in by `llmstep eval --update-cards`.
<!-- eval:end -->

## Licence

Shakespeare's text is in the public domain; the corpus comes from the Open Knowledge Foundation's
`shakespeare` 0.6 package (MIT; its COPYING.txt: CC BY 2.5 for content), see `data/README.md`.
These weights are distributed with llmstep under the same terms.
"""


def export(model: Llama, out_dir: Path, cfg: TrainConfig, info: dict, log_path: Path) -> Path:
    """Write the Hugging Face layout (bf16), tokenizer.json, model card and training log to out_dir."""
    gen_config = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "max_length": model.config.max_seq_len}
    save(model, out_dir, tokenizer=None, generation_config=gen_config, dtype=torch.bfloat16)
    atomic_write_bytes(out_dir / "tokenizer.json", Path(cfg.tokenizer).read_bytes())  # byte-identical to data/'s
    score = evaluate_model(out_dir, "val", corpus=cfg.corpus, seq_len=model.config.max_seq_len)
    info = info | {"export_val_ppl": score.perplexity, "path": str(out_dir)}
    atomic_write_text(out_dir / "README.md", model_card(info))
    atomic_write_bytes(out_dir / "train.log", log_path.read_bytes())
    return out_dir


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def check_sources(cfg: TrainConfig, config: LlamaConfig) -> None:
    """init_from and teacher, from their configs (no weight read): the start must have the student's shape, the
    teacher the student's vocabulary and a context of at least seq_len."""
    for what, path in (("init_from", cfg.init_from), ("teacher", cfg.teacher)):
        if not path:
            continue
        try:
            other = read_config(path)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{what}: {e}") from None
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        if what == "init_from" and any(getattr(other, f) != getattr(config, f) for f in SHAPE_FIELDS + ("vocab_size",)):
            raise ValueError(f"init_from {path}: its shape differs from the preset's; pass the matching preset and "
                             "shape")
        if what == "teacher" and other.vocab_size != config.vocab_size:
            raise ValueError(f"teacher {path}: its vocabulary ({other.vocab_size}) differs from the student's "
                             f"({config.vocab_size})")
        if what == "teacher" and other.max_seq_len < cfg.seq_len:
            raise ValueError(f"teacher {path}: its context ({other.max_seq_len} tokens) is shorter than the "
                             f"training windows (seq_len {cfg.seq_len})")


def train(cfg: TrainConfig, out: Path, shape: dict, resume: bool = False, stop_after: int | None = None,
          export_dir: Path | None = None, command: str = "", quiet: bool = False) -> Llama:
    """Every setting, path and file is checked before the run folder is made or anything written in it."""
    check_train_config(cfg)
    if stop_after is not None and not (is_int(stop_after) and stop_after >= 1):
        raise ValueError(f"stop_after must be a positive integer (the step whose checkpoint to stop at), "
                         f"got {stop_after!r}")
    ckpt_path = check_run_folder(out, resume)  # no fresh run over a checkpoint, no resume without one
    if export_dir is not None:
        check_save_folder(export_dir)  # refused now, not after the run
    device = pick_device(cfg.device)
    tokenizer = LlamaTokenizer.from_file(cfg.tokenizer).tok  # a bad file is named (core.tokens checks it)
    config = model_config(cfg.preset, tokenizer, **shape)  # its shape refused before the corpus is read
    train_ids = torch.tensor(data.encode_split(tokenizer, data.read_split("train", cfg.corpus)))  # [N]
    if len(train_ids) <= cfg.seq_len + 1:
        raise ValueError(f"{data.split_path('train', cfg.corpus)}: the train split has {len(train_ids)} tokens, "
                         f"fewer than one window of {cfg.seq_len}")
    val_ids = split_ids(tokenizer, "val", cfg.corpus)  # refused if it has nothing to predict (an empty file)

    if cfg.seq_len > config.max_seq_len:
        raise ValueError(f"seq_len {cfg.seq_len} is longer than the model's context {config.max_seq_len}")
    check_fits(training_bytes(config, cfg.batch_size, cfg.seq_len), device,
               f"training {cfg.preset} with batches of {cfg.batch_size} x {cfg.seq_len} tokens")
    check_sources(cfg, config)
    torch.manual_seed(cfg.seed)
    model = Llama(config)
    init_weights(model, cfg.seed)
    if cfg.init_from:
        model.load_state_dict(load_model(cfg.init_from, device="cpu", dtype=torch.float32).state_dict())
    teacher = None  # read in its stored dtype: it only runs forward
    if cfg.teacher:
        teacher = load_model(cfg.teacher, device=device).eval().requires_grad_(False)
    model.to(device).train()
    optimizer = make_optimizer(model, cfg)

    step, elapsed, history = 0, 0.0, []
    commands = [command]
    if resume:
        state = resume_state(ckpt_path, model, optimizer, asdict(cfg), asdict(config))
        step, elapsed, history = state["step"], state["elapsed_seconds"], state["history"]
        if stop_after is not None and stop_after <= step:  # it would train nothing, and say it stopped there
            raise ValueError(f"stop_after {stop_after} is not past the checkpoint's step ({step}): give a later step, "
                             f"up to --steps ({cfg.steps}), or none")
        commands = state["commands"] + ([command] if step < cfg.steps else [])  # a pure re-export adds none
    out.mkdir(parents=True, exist_ok=True)  # the run's folder once every setting and file is known to work
    log = open_log(out, step if resume else None)  # a resumed run's log is cut after the checkpoint's step
    if resume:
        log.info(f"resumed from {ckpt_path} at step {step} (the lines above are the run up to that step)")

    n_params = sum(p.numel() for p in model.parameters())
    tokens_per_step = cfg.batch_size * cfg.seq_len
    log.info(f"model {config.dim}x{config.n_layers} ({n_params:,} parameters), "
             f"{len(train_ids):,} train tokens, {tokens_per_step} tokens/step, {cfg.steps} steps, "
             f"device {device}")

    saved_at = step if resume else None  # the step of the last good checkpoint on disk

    def diverged(what: str) -> ValueError:
        kept = f"{ckpt_path} keeps step {saved_at}" if saved_at is not None else "no checkpoint was written"
        return ValueError(f"training diverged at step {step + 1}: {what}; stopped without saving ({kept}); "
                          f"try a lower --lr than {cfg.lr:g}")

    def checkpoint(at_step: int) -> None:
        nonlocal saved_at
        tensors = model.state_dict() | {f"optimizer.{i}.{k}": v for i, s in optimizer.state_dict()["state"].items()
                                        for k, v in s.items() if isinstance(v, torch.Tensor)}
        bad = first_nonfinite(tensors)
        if bad is not None:
            raise diverged(f"{bad} is no longer finite")
        save_train_state(ckpt_path, model, optimizer, {
            "step": at_step, "elapsed_seconds": elapsed, "history": history, "commands": commands,
            "train_config": asdict(cfg), "model_config": asdict(config),
        })
        saved_at = at_step

    last = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    bar = tqdm(total=cfg.steps, initial=step, unit="step", dynamic_ncols=True, disable=quiet, file=sys.stderr)
    t0 = time.perf_counter()
    while step < last:
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(train_ids, step, cfg)
        x, y = x.to(device), y.to(device)
        with autocast(device):
            logits = model(x)  # [B, T, vocab]
        if teacher is None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        else:  # cross-entropy against the teacher's distribution: its KL divergence to the student, plus a constant
            with torch.no_grad(), autocast(device):
                p_teacher = torch.softmax(teacher(x).float(), dim=-1)  # [B, T, vocab]
            loss = -(p_teacher * torch.log_softmax(logits.float(), dim=-1)).sum(-1).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if not (math.isfinite(loss.item()) and math.isfinite(float(grad_norm))):  # before the step spoils weights
            raise diverged(f"the loss is {loss.item()} and the gradient norm {float(grad_norm)}")
        optimizer.step()
        step += 1

        now = time.perf_counter()
        elapsed, t0 = elapsed + (now - t0), now
        tok_s = step * tokens_per_step / max(elapsed, 1e-9)
        bar.update()
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}")
        record = {"step": step, "loss": loss.item(), "lr": lr, "grad_norm": float(grad_norm)}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            record["val_loss"] = val_loss(model, val_ids, cfg, device)
        history.append(record)
        if step % cfg.eval_every == 0 or step == cfg.steps or step == 1:
            val = f" val {record['val_loss']:.4f}" if "val_loss" in record else ""
            log.info(f"step {step:5d}/{cfg.steps} loss {loss.item():.4f}{val} lr {lr:.2e} "
                     f"grad_norm {float(grad_norm):.2f} {tok_s:,.0f} tok/s elapsed {elapsed / 60:.1f} min")
        if step % cfg.save_every == 0 or step == last:
            checkpoint(step)
        t0 = time.perf_counter()  # evaluation and checkpointing are not training time
    bar.close()

    if step < cfg.steps:
        log.info(f"stopped after step {step} (--stop-after); continue with --resume")
        return model
    if export_dir is not None:
        final_val = next(r["val_loss"] for r in reversed(history) if "val_loss" in r)
        info = asdict(cfg) | {
            "name": export_dir.name, "role": "the target" if cfg.preset == "target" else f"the {cfg.preset}",
            "config": asdict(config), "n_params": n_params, "n_rep": config.n_rep, "train_tokens": len(train_ids),
            "command": " && ".join(commands), "tokens_seen": step * tokens_per_step, "wall_seconds": elapsed,
            "hardware": hardware(device), "final_val_loss": final_val, "betas": (cfg.beta1, cfg.beta2),
            "precision": "bf16 autocast" if device.type == "cuda" else "fp32",
        }
        export(model, export_dir, cfg, info, out / LOG)
        log.info(f"exported {export_dir} ({elapsed / 60:.1f} min of training)")
    return model


def train_config(preset: str = "target", **overrides) -> TrainConfig:
    """The preset's recipe (RECIPES) over TrainConfig's defaults, then every override that is not None."""
    if preset not in RECIPES:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(RECIPES)}")
    recipe = asdict(TrainConfig()) | RECIPES[preset] | {"preset": preset}
    unknown = set(overrides) - set(recipe)
    if unknown:
        raise ValueError(f"not TrainConfig fields: {sorted(unknown)}")
    cfg = TrainConfig(**recipe | {k: v for k, v in overrides.items() if v is not None})
    check_train_config(cfg)
    return cfg


def check_train_config(cfg: TrainConfig) -> None:
    """What the loop needs beyond each field's type: an eval slice to predict, AdamW's settings in BOUNDS."""
    for name, (span, inside) in BOUNDS.items():
        if not (is_finite_number(getattr(cfg, name)) and inside(getattr(cfg, name))):
            raise ValueError(f"{name} must be a number in {span}, got {getattr(cfg, name)!r}")
    if not is_int(cfg.eval_tokens) or cfg.eval_tokens < 2:
        raise ValueError(f"eval_tokens must be an integer >= 2 (a context token and one to predict), "
                         f"got {cfg.eval_tokens!r}")
