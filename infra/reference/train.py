"""Train a small Llama (GQA) from scratch on CPU: seeded, logged, with a progress bar."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReferenceSize:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float


SIZES = {
    # a few hundred thousand parameters: trains in about a minute on 2 cores (tests, demo)
    "tiny": ReferenceSize(vocab_size=2048, hidden_size=96, num_hidden_layers=6, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=256, seq_len=128, batch_size=16, steps=500,
                          lr=3e-3),
    # about 3.4 million parameters, 12 decoder layers: the benchmark subject. Deep and narrow so block
    # pruning has real choices (10 unprotected blocks); a fixed step count, never a wall-clock cap, so
    # the same seed gives the same model on a busy machine (2.4 s a step measured on 2 cores beside a
    # test run, i.e. about 100 minutes; less on an idle or larger machine)
    "small": ReferenceSize(vocab_size=8192, hidden_size=128, num_hidden_layers=12, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=384, seq_len=128, batch_size=16, steps=2500,
                           lr=2e-3),
}


def model_config(size: ReferenceSize, tokenizer) -> LlamaConfig:  # noqa: ANN001
    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=size.hidden_size,
                       intermediate_size=size.intermediate_size, num_hidden_layers=size.num_hidden_layers,
                       num_attention_heads=size.num_attention_heads, num_key_value_heads=size.num_key_value_heads,
                       max_position_embeddings=max(512, size.seq_len), tie_word_embeddings=True,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def train(size: ReferenceSize, tokenizer, stream: torch.Tensor, out_log: Path, seed: int = 0,  # noqa: ANN001
          progress: bool = True) -> tuple[LlamaForCausalLM, dict]:
    """Next-token training on random windows of the token `stream` (AdamW, warmup + cosine)."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(model_config(size, tokenizer))
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=size.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, size.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return size.lr * (step + 1) / warmup
        return size.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, size.steps - warmup)))

    started = time.monotonic()
    losses: list[float] = []
    ema = None
    with out_log.open("w") as log_fh, tqdm(total=size.steps, desc="training", disable=not progress, mininterval=5) as bar:
        for step in range(size.steps):
            starts = torch.randint(0, stream.numel() - size.seq_len - 1, (size.batch_size,), generator=generator)
            batch = torch.stack([stream[s: s + size.seq_len] for s in starts.tolist()])
            for group in optim.param_groups:
                group["lr"] = lr_at(step)
            loss = model(input_ids=batch, labels=batch).loss
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            value = float(loss.detach())
            losses.append(value)
            ema = value if ema is None else 0.98 * ema + 0.02 * value
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.3f}")
            if not progress and ((step + 1) % max(1, size.steps // 20) == 0):  # a log, not a terminal: 20 lines
                elapsed = time.monotonic() - started
                log.info("training step %d/%d: loss %.3f, elapsed %.0fs, about %.0fs left", step + 1, size.steps, ema,
                         elapsed, elapsed / (step + 1) * (size.steps - step - 1))
            if step % 25 == 0 or step == size.steps - 1:
                log_fh.write(json.dumps({"step": step, "loss": value, "lr": lr_at(step),
                                         "elapsed_s": round(time.monotonic() - started, 2)}) + "\n")
    model.eval()
    tail = losses[-50:]
    stats = {"steps": len(losses), "final_train_loss": sum(tail) / len(tail),
             "train_seconds": round(time.monotonic() - started, 1), "size": asdict(size)}
    return model, stats
