"""generate_samples: the dense and the compressed model's greedy continuations of the same fixed prompts, and how
repetitive they are (the verdict's repetition bound reads it)."""

from __future__ import annotations

import logging

from prefect import task
from pydantic import BaseModel, ConfigDict

from infra.config import RuntimeSettings
from infra.memory import roomy_allocator
from pip_core.repetition import NGRAM, distinct_share, ngram_name
from pip_core.samples import greedy_continuations
from tasks._common import key_from
from tasks.models import load_model
from tasks.refs import ModelRef

log = logging.getLogger(__name__)


class Samples(BaseModel):
    """Greedy continuations, one per prompt, and the share of distinct n-grams (`ngram`) among their tokens."""

    model_config = ConfigDict(frozen=True)

    texts: list[str] = []
    #: pip_core.repetition.distinct_share of the continuations' tokens (None: no continuations)
    distinct: float | None = None
    ngram: int = NGRAM


@task(name="generate-samples", cache_key_fn=key_from("model", "prompts", "new_tokens", "runtime"),
      persist_result=True, result_serializer="json")
def generate_samples(model: ModelRef, prompts: tuple[str, ...], new_tokens: int,
                     runtime: RuntimeSettings = RuntimeSettings()) -> Samples:
    """Greedy continuations (deterministic, so cached by content like any evaluation)."""
    if not prompts or new_tokens == 0:
        return Samples()
    net, tokenizer = load_model(model, runtime, keep_slot=True)
    with roomy_allocator():  # forward only (infra.memory)
        texts = greedy_continuations(net, tokenizer, prompts, new_tokens)
    for prompt, text in zip(prompts, texts, strict=True):
        log.info("sample %s: %r -> %r", model.fingerprint[:12], prompt, text)
    tokens = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]  # the text read back
    distinct = distinct_share(tokens)
    log.info("samples %s: share of distinct %s %s", model.fingerprint[:12], ngram_name(),
             "none" if distinct is None else f"{distinct:.3f}")
    return Samples(texts=texts, distinct=distinct)
