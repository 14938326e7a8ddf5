"""Train Tandem's default model from Python's own documentation, on a CPU, in a few minutes.

Two products, written into one folder that Hugging Face ``transformers`` can load as a
``LlamaForCausalLM`` (this module itself never imports transformers):

* ``tokenizer.json``: a byte-level BPE tokenizer (``tokenizers`` library) whose only special
  token, ``<|endoftext|>``, ends documents; there is no BOS token.
* ``model.safetensors`` + ``config.json``: a small Llama (RMSNorm, rotary embeddings in the
  HF "rotate_half" convention, SwiGLU MLP, grouped-query attention, tied embeddings) whose
  parameter names are those of an HF Llama checkpoint.

The default budget is wall-clock time (``--max-seconds``, 240): the learning rate warms up
over the first steps and then follows a cosine over the fraction of the budget spent, so a
machine that is slower than expected, or busy, trains for fewer steps but still anneals. A
floor of steps (``--min-steps``, 300; an idle 2-core machine does about 400 in the budget)
keeps a badly overloaded machine from caching a model that has not learnt to write: there the
run takes longer than the budget, and the schedule follows the steps instead. A build given
only ``--max-steps`` schedules by step and is reproducible bit for bit.

Usage: ``python -m cluster.default_model.train --out DIR [--max-seconds S] [--min-steps N] [--max-steps N]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __name__ == "__main__":
    # Run as a command, torch is not loaded yet, so this still reaches OpenMP: idle threads
    # sleep instead of spinning. That costs ~5% on an idle machine, but on a busy one (other
    # processes on the same cores) spinning threads made each step ~6x slower.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

from cluster.default_model.corpus import corpus_fingerprint, gather_corpus

EOS_TOKEN = "<|endoftext|>"
DEFAULT_MAX_SECONDS = 240.0
DEFAULT_MIN_STEPS = 300


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf_config(self, eos_token_id: int) -> dict:
        """``config.json`` in the transformers-5 form (``rope_parameters``, ``dtype``)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": True,
            "vocab_size": self.vocab_size,
            "bos_token_id": None,
            "eos_token_id": eos_token_id,
            "dtype": "float32",
            "attention_bias": False,
            "mlp_bias": False,
        }


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 256
    batch_size: int = 8
    peak_lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    log_every_s: float = 10.0
    vocab_size: int = 4096
    seed: int = 0


# ---------------------------------------------------------------------------- the model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as HF's LlamaRMSNorm, so logits agree to float rounding.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_cos_sin(cfg: ModelConfig, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [seq_len, head_dim], frequencies repeated as (f0..fn, f0..fn)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # KV head j serves query heads j*g .. j*g+g-1, as HF's repeat_kv does.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TinyLlama(nn.Module):
    """A Llama whose ``state_dict`` names match an HF checkpoint; ``lm_head`` is tied."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        cos, sin = rotary_cos_sin(cfg, cfg.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self) -> None:
        """GPT-2 style: N(0, 0.02), residual outputs scaled down by depth."""
        std = 0.02
        residual_std = std / math.sqrt(2 * self.cfg.num_hidden_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=residual_std)
            else:
                nn.init.normal_(p, std=std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        return F.linear(x, self.model.embed_tokens.weight)


# ---------------------------------------------------------------------------- the tokenizer


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style); no normaliser, no BOS, ``<|endoftext|>`` is id 0."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tokenizer


def tokenizer_config(max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "bos_token": None,
        "pad_token": EOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }


def encode_documents(tokenizer: Tokenizer, docs: list[str], eos_id: int) -> torch.Tensor:
    """One long token stream: each document followed by ``<|endoftext|>``."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int64)


# ---------------------------------------------------------------------------- training


def lr_at(step: int, progress: float, tc: TrainConfig) -> float:
    """Linear warmup over the first steps, times a cosine over the run's progress (0 to 1).

    Progress is a fraction of the step budget or of the time budget, so a run that is slowed
    down (say by other processes on the machine) still ends with a fully decayed rate.
    """
    warmup = min(1.0, (step + 1) / tc.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return tc.peak_lr * warmup * (tc.min_lr_ratio + (1.0 - tc.min_lr_ratio) * cosine)


def _batch(data: torch.Tensor, tc: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    """``batch_size`` random windows of ``seq_len + 1`` tokens."""
    starts = torch.randint(0, len(data) - tc.seq_len - 1, (tc.batch_size,), generator=gen)
    return torch.stack([data[s : s + tc.seq_len + 1] for s in starts.tolist()])


def _loss(model: TinyLlama, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: TinyLlama, data: torch.Tensor, tc: TrainConfig, batches: int = 4) -> float:
    """Mean loss over fixed windows spread evenly through ``data``."""
    model.eval()
    n = batches * tc.batch_size
    last = len(data) - tc.seq_len - 1
    starts = [i * last // max(1, n - 1) for i in range(n)]
    windows = torch.stack([data[s : s + tc.seq_len + 1] for s in starts])
    losses = [_loss(model, windows[i : i + tc.batch_size]).item() for i in range(0, n, tc.batch_size)]
    model.train()
    return sum(losses) / len(losses)


def _optimizer(model: TinyLlama, tc: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": tc.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=tc.peak_lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)


def _log(msg: str) -> None:
    print(f"[tandem-default-model] {msg}", file=sys.stderr, flush=True)


def train_model(
    model: TinyLlama,
    data: torch.Tensor,
    tc: TrainConfig,
    max_seconds: float | None,
    max_steps: int | None,
    min_steps: int = 0,
) -> dict:
    """Train in place until either budget is spent; returns a summary.

    A time budget ends only once ``min_steps`` steps are done as well.

    With only ``max_steps``, progress (hence every learning rate) is a function of the step,
    and the result is bit-for-bit reproducible. A time budget makes the run's length, and so
    its weights, depend on the machine's speed at the time.
    """
    if max_seconds is None and max_steps is None:
        raise ValueError("give max_seconds, max_steps or both")
    gen = torch.Generator().manual_seed(tc.seed + 1)
    opt = _optimizer(model, tc)
    tokens_per_step = tc.batch_size * tc.seq_len
    start = last_log = time.perf_counter()
    step, progress, ema = 0, 0.0, None
    while progress < 1.0:
        lr = lr_at(step, progress, tc)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = _loss(model, _batch(data, tc, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        step += 1
        value = loss.item()
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        now = time.perf_counter()
        elapsed = now - start
        progress = max(
            step / max_steps if max_steps is not None else 0.0,
            min(elapsed / max_seconds, step / min_steps if min_steps else 1.0) if max_seconds is not None else 0.0,
        )
        if now - last_log >= tc.log_every_s or progress >= 1.0:
            eta = elapsed * max(0.0, 1.0 - progress) / progress
            _log(
                f"step {step} ({progress:.0%}) loss {value:.3f} (avg {ema:.3f}) lr {lr:.2e} "
                f"{step * tokens_per_step / elapsed:,.0f} tok/s elapsed {elapsed:.0f}s ETA {eta:.0f}s"
            )
            last_log = now
    return {
        "steps": step,
        "final_loss": value,
        "final_loss_avg": ema,
        "tokens_seen": step * tokens_per_step,
        "train_seconds": round(time.perf_counter() - start, 1),
    }


# ---------------------------------------------------------------------------- the build


def _split(docs: list[str], every: int = 50) -> tuple[list[str], list[str]]:
    """Every ``every``-th document is held out to measure loss on unseen text."""
    train = [d for i, d in enumerate(docs) if i % every != every - 1]
    held_out = [d for i, d in enumerate(docs) if i % every == every - 1]
    return train, held_out


def save_model(model: TinyLlama, out: Path, eos_id: int) -> None:
    tensors = {name: t.detach().contiguous().clone() for name, t in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", model.cfg.to_hf_config(eos_id))
    _write_json(out / "generation_config.json", {"eos_token_id": eos_id, "bos_token_id": None})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build(
    out: Path,
    max_seconds: float | None = DEFAULT_MAX_SECONDS,
    max_steps: int | None = None,
    min_steps: int = DEFAULT_MIN_STEPS,
    max_corpus_bytes: int | None = None,
    tc: TrainConfig = TrainConfig(),
    model_overrides: dict | None = None,
) -> dict:
    """Write tokenizer, config and weights into ``out`` (created if missing); returns a summary.

    Seeds and thread count are set for the duration of the build only, so calling this from a
    running process leaves its RNG state and thread pool as they were.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    docs = gather_corpus(max_corpus_bytes)
    corpus_bytes = sum(len(d.encode("utf-8")) for d in docs)
    _log(f"corpus: {len(docs)} documents, {corpus_bytes:,} bytes")

    tokenizer = train_tokenizer(docs, tc.vocab_size)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    tokenizer.save(str(out / "tokenizer.json"))
    cfg = ModelConfig(vocab_size=tokenizer.get_vocab_size(), **(model_overrides or {}))
    _write_json(out / "tokenizer_config.json", tokenizer_config(cfg.max_position_embeddings))

    train_docs, held_out_docs = _split(docs)
    train_data = encode_documents(tokenizer, train_docs, eos_id)
    held_out = encode_documents(tokenizer, held_out_docs, eos_id) if held_out_docs else train_data
    _log(f"tokenizer: {cfg.vocab_size} tokens; {len(train_data):,} training tokens")

    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(tc.seed)
            torch.set_num_threads(2)
            model = TinyLlama(cfg)
            model.init_weights()
            n_params = sum(p.numel() for p in model.parameters())
            _log(f"model: {n_params:,} parameters, {asdict(cfg)}")
            summary = train_model(model, train_data, tc, max_seconds, max_steps, min_steps)
            if len(held_out) > tc.seq_len + 1:
                summary["held_out_loss"] = round(evaluate(model, held_out, tc), 4)
            save_model(model, out, eos_id)
    finally:
        torch.set_num_threads(threads)

    summary.update(
        parameters=n_params,
        corpus_documents=len(docs),
        corpus_bytes=corpus_bytes,
        corpus_sha256=corpus_fingerprint(docs),
        training_tokens=len(train_data),
        python=platform.python_version(),
        torch=torch.__version__,
        build_seconds=round(time.perf_counter() - t0, 1),
        train_config=asdict(tc),
    )
    _write_json(out / "tandem_build.json", summary)
    _log(
        f"done in {summary['build_seconds']}s: {summary['steps']} steps, "
        f"loss {summary['final_loss_avg']:.3f}, held-out loss {summary.get('held_out_loss')}"
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.default_model.train", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="folder to write the model into")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help=f"training time budget (default {DEFAULT_MAX_SECONDS:.0f} unless --max-steps is given)",
    )
    parser.add_argument(
        "--max-steps", type=int, default=None, help="step budget; alone, the build is reproducible"
    )
    parser.add_argument(
        "--min-steps", type=int, default=DEFAULT_MIN_STEPS,
        help=f"with a time budget, train at least this many steps (default {DEFAULT_MIN_STEPS})",
    )
    parser.add_argument(
        "--max-corpus-bytes", type=int, default=None, help="train on a prefix of the corpus"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.max_steps is not None and args.max_steps < 1:
        parser.error("--max-steps must be at least 1")
    if args.min_steps < 0:
        parser.error("--min-steps must not be negative")
    if args.max_seconds is not None and args.max_seconds <= 0:
        parser.error("--max-seconds must be positive")
    if args.max_seconds is None and args.max_steps is None:
        args.max_seconds = DEFAULT_MAX_SECONDS
    build(
        args.out,
        max_seconds=args.max_seconds,
        max_steps=args.max_steps,
        min_steps=args.min_steps,
        max_corpus_bytes=args.max_corpus_bytes,
        tc=TrainConfig(seed=args.seed),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
