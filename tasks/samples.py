"""generate_samples: the dense and the compressed model's greedy continuations of the same fixed prompts."""

from __future__ import annotations

import logging

from prefect import task

from infra.config import RuntimeSettings
from pip_core.samples import greedy_continuations
from tasks._common import key_from
from tasks.models import load_model
from tasks.refs import ModelRef

log = logging.getLogger(__name__)


@task(name="generate-samples", cache_key_fn=key_from("model", "prompts", "new_tokens", "runtime"),
      persist_result=True, result_serializer="json")
def generate_samples(model: ModelRef, prompts: tuple[str, ...], new_tokens: int,
                     runtime: RuntimeSettings = RuntimeSettings()) -> list[str]:
    """Greedy continuations (deterministic, so cached by content like any evaluation)."""
    if not prompts or new_tokens == 0:
        return []
    net, tokenizer = load_model(model, runtime, keep_slot=True)
    texts = greedy_continuations(net, tokenizer, prompts, new_tokens)
    for prompt, text in zip(prompts, texts, strict=True):
        log.info("sample %s: %r -> %r", model.fingerprint[:12], prompt, text)
    return texts
