"""quick_eval (held-out perplexity after each step), general_eval (the evaluation kit's general held-out set: what
the verdict reads) and evaluate (lm-eval, the same code as `pipprune eval`)."""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

from prefect import task
from pydantic import BaseModel, ConfigDict

from infra import eval_provenance as provenance
from infra.config import RuntimeSettings
from infra.eval_kit import KIT_TASKS, MAX_LENGTH, GeneralSet, eval_kit, kit_tasks_dir
from infra.eval_kit import recipe as kit_recipe
from infra.hashing import sha256_file, tree_digest
from infra.memory import roomy_allocator
from pip_core import io as core_io
from pip_core.divergence import CachedDense, divergence
from pip_core.perplexity import perplexity
from pip_core.precision import precision_name
from pip_core.token_figures import TokenFigures, token_figures
from tasks._common import content_key, key_from
from tasks.calibration import read_heldout
from tasks.models import ensure_local, load_model, placement_for
from tasks.refs import CalibrationRef, ModelRef

log = logging.getLogger(__name__)


@task(name="quick-eval", cache_key_fn=key_from("model", "calib", "runtime", "reference"),
      persist_result=True, result_serializer="json")
def quick_eval(model: ModelRef, calib: CalibrationRef, runtime: RuntimeSettings = RuntimeSettings(),
               reference: ModelRef | None = None) -> dict[str, float]:
    """Perplexity on the texts held out from scoring; with `reference` (the dense model) also KL to it, the
    perplexity then read from the same forward pass (each held-out token costs a forward: one pass, not two)."""
    texts, max_length = read_heldout(calib), calib.max_length
    if not texts:
        return {}
    net, tokenizer = load_model(model, runtime, seq_len=max_length)
    if reference is None:
        metrics = perplexity(net, tokenizer, texts, max_length=max_length)
        log.info("quick eval: perplexity %.3f on %d held-out texts", metrics["perplexity"], len(texts))
        return {"heldout_perplexity": metrics["perplexity"], "heldout_nll": metrics["nll"]}
    return divergence_metrics(reference, net, tokenizer, texts, max_length,
                              same=reference.fingerprint == model.fingerprint, runtime=runtime)


def divergence_metrics(reference: ModelRef | Path, net, tokenizer, texts: list[str], max_length: int,  # noqa: ANN001
                       same: bool = False, runtime: RuntimeSettings | None = None) -> dict[str, float]:
    """heldout_perplexity and heldout_nll of `net`, heldout_kl (mean per-token KL(dense || model)),
    heldout_top1_agreement and heldout_ppl_ratio. `same`: `net` is the dense model, whose log-probabilities
    are written now (its perplexity is read from them)."""
    if same:
        if isinstance(reference, ModelRef):  # the dense model is in hand now: keep its log-probabilities for later
            nll = dense_logprobs(reference, tokenizer, texts, max_length, runtime).mean_nll()
        else:
            nll = perplexity(net, tokenizer, texts, max_length=max_length)["nll"]
        log.info("quick eval: perplexity %.3f on %d held-out texts", math.exp(nll), len(texts))
        return {"heldout_perplexity": math.exp(nll), "heldout_nll": nll, "heldout_kl": 0.0,
                "heldout_top1_agreement": 1.0, "heldout_ppl_ratio": 1.0}
    dense = (core_io.load(reference)[0] if isinstance(reference, Path)
             else dense_logprobs(reference, tokenizer, texts, max_length, runtime))
    m = divergence(dense, net, tokenizer, texts, max_length=max_length)
    log.info("quick eval: perplexity %.3f on %d held-out texts; KL to dense %.4f, top-1 agreement %.3f, perplexity "
             "ratio %.3f", m["ppl_pruned"], len(texts), m["kl"], m["top1_agreement"], m["ppl_ratio"])
    return {"heldout_perplexity": m["ppl_pruned"], "heldout_nll": math.log(m["ppl_pruned"]), "heldout_kl": m["kl"],
            "heldout_top1_agreement": m["top1_agreement"], "heldout_ppl_ratio": m["ppl_ratio"]}


def dense_logprobs(reference: ModelRef, tokenizer, texts: list[str], max_length: int,  # noqa: ANN001
                   runtime: RuntimeSettings | None = None) -> CachedDense:
    """The dense model's held-out log-probabilities, on disk by content (model, texts, length).

    Written while the dense model is the model in hand (the run's first quick eval), so no second
    copy of it is ever kept beside the pruned one; a run resumed elsewhere reads it once to rebuild them.
    """
    from infra.settings import Settings

    key = content_key(reference.fingerprint, texts, max_length)
    folder = Settings().work_dir / "dense-logprobs" / key[:32]
    cached = CachedDense.open(folder)
    if cached is not None:
        return cached
    net, _ = load_model(reference, runtime, transient=True, seq_len=max_length)
    return CachedDense.build(net, tokenizer, texts, max_length, folder)


class GeneralFigures(BaseModel):
    """A model's figures on the evaluation kit's general held-out set, and that set's record (what, sha256, tokens).

    `metrics`: general_perplexity, general_nll, general_tokens, and against the dense model general_ppl_ratio and
    general_top1_agreement (1.0 for the dense model itself).
    """

    model_config = ConfigDict(frozen=True)

    metrics: dict[str, float]
    heldout: dict


def _general_key(context, parameters: dict) -> str:  # noqa: ANN001 - prefect's TaskRunContext
    """The usual content key plus the kit's recipe: a rebuilt kit is another held-out set."""
    return content_key(key_from("model", "runtime", "reference")(context, parameters), kit_recipe())


@task(name="general-eval", cache_key_fn=_general_key, persist_result=True, result_serializer="json")
def general_eval(model: ModelRef, runtime: RuntimeSettings = RuntimeSettings(),
                 reference: ModelRef | None = None) -> GeneralFigures:
    """Perplexity on the general held-out set (infra.eval_kit: at least 30k tokens of a novel no reference model
    saw); against `reference` (the dense model) the perplexity ratio and top-1 agreement, read from the dense
    model's per-token NLL and argmax on disk. `reference` None or `model` itself: the dense model, measured and
    its per-token figures written while it is the model in hand. Both models are measured under bf16 autocast
    where the CPU has it natively (pip_core.precision: 1.7x faster, the ratio the same to 4 digits); the record
    names the precision."""
    started = time.perf_counter()
    net, tokenizer = load_model(model, runtime, keep_slot=True)
    general = eval_kit().general_set(tokenizer, min(MAX_LENGTH, getattr(net.config, "max_position_embeddings",
                                                                          MAX_LENGTH)))
    windows = general.encode(tokenizer)
    with roomy_allocator():  # forward only (infra.memory): 1.5x faster
        if reference is None or reference.fingerprint == model.fingerprint:
            own = dense_token_figures(model, general, windows, net, runtime)
            figures = own.against(own)
        else:
            figures = token_figures(net, windows, cpu_bf16=True).against(
                dense_token_figures(reference, general, windows, None, runtime))
    metrics = {f"general_{k}": v for k, v in figures.items()}
    log.info("general held-out set (%d tokens): perplexity %.3f, ratio to dense %.3f, top-1 agreement %.3f (%.0f s)",
             general.tokens, metrics["general_perplexity"], metrics["general_ppl_ratio"],
             metrics["general_top1_agreement"], time.perf_counter() - started)
    return GeneralFigures(metrics=metrics, heldout={**general.record(), "precision": _precision(model, runtime)})


def _precision(model: ModelRef, runtime: RuntimeSettings | None) -> str:
    """The precision the general set is measured in for `model` as `runtime` places it (pip_core.precision)."""
    import torch

    placement = placement_for(model, runtime or RuntimeSettings())
    return precision_name(torch.device(placement.device).type, getattr(torch, placement.dtype))


def dense_token_figures(reference: ModelRef, general: GeneralSet, windows: list[list[int]], net=None,  # noqa: ANN001
                        runtime: RuntimeSettings | None = None) -> TokenFigures:
    """The dense model's NLL and argmax per token of the general set, on disk by content (model, token ids).

    `net`: the dense model when it is in hand; else it is read for this once (a resumed run, a cleared cache)
    and dropped. The file is a few hundred KB, written whole (rename) or not at all.
    """
    from infra.settings import Settings

    key = content_key(reference.fingerprint, general.sha256, windows, _precision(reference, runtime))
    path = Settings().work_dir / "general-tokens" / f"{key[:32]}.pt"
    if path.is_file():
        return TokenFigures.load(path)
    if net is None:
        net, _ = load_model(reference, runtime, transient=True)
    figures = token_figures(net, windows, cpu_bf16=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    figures.save(tmp)
    os.replace(tmp, path)
    return figures


def reference_divergence(model_dir: Path, reference_dir: Path, heldout: Path | None,
                         max_length: int = 256, device: str | None = None) -> dict[str, float]:
    """`pipprune eval --reference`: KL etc. to the dense model with 95% document-bootstrap intervals."""
    from pip_core import bootstrap
    from pip_core.divergence import doc_stats, read_texts
    from pip_core.errors import PipCoreError

    if not Path(reference_dir).is_dir():
        raise PipCoreError(f"reference model directory not found: {reference_dir}")
    path = Path(heldout) if heldout else Path(reference_dir) / "tasks" / "persuasion.jsonl"
    if heldout is None and not path.is_file():
        raise PipCoreError(f"{reference_dir} has no tasks/persuasion.jsonl; pass --heldout FILE")
    texts = read_texts(path)
    dense, tokenizer = core_io.load(Path(reference_dir), device=device)
    net, _ = core_io.load(Path(model_dir), device=device, tokenizer=False)
    stats = doc_stats(dense, net, tokenizer, texts, max_length=max_length)
    out: dict[str, float] = {**stats.metrics(), "max_length": float(max_length)}
    if len(texts) >= 2:
        for metric in ("kl", "top1_agreement", "ppl_ratio"):
            ci = bootstrap.interval(stats, metric)
            out[f"{metric}_ci95_low"], out[f"{metric}_ci95_high"] = ci.low, ci.high
    out["heldout_sha256"] = sha256_file(path)  # type: ignore[assignment]
    return out




def tasks_digest(include_path: str | None, tasks: tuple[str, ...] = ()) -> str | None:
    """Content of the task definitions, so editing a local task invalidates cached evaluations; the evaluation
    kit's tasks (no include path) are named by the kit's recipe."""
    if include_path:
        return tree_digest(Path(include_path))
    return f"eval-kit:{kit_recipe()}" if set(tasks) & set(KIT_TASKS) else None


class EvalResult(BaseModel):
    """lm-eval figures {task: {metric: value}} and the provenance record of the run that produced them."""

    model_config = ConfigDict(frozen=True)

    results: dict[str, dict[str, float]]
    provenance: dict = {}


@task(name="evaluate", cache_key_fn=key_from("model", "tasks", "tasks_content", "limit", "runtime"),
      persist_result=True, result_serializer="json")
def evaluate(model: ModelRef, tasks: tuple[str, ...], include_path: str | None, tasks_content: str | None,
             limit: int | None,
             runtime: RuntimeSettings = RuntimeSettings()) -> EvalResult:
    """Run lm-eval tasks on the model directory, exactly as `pipprune eval` does, recording what produced them.

    With no `include_path`, the evaluation kit's task names (infra.eval_kit.KIT_TASKS, the WordNet cloze a run gets
    by default) are found in the kit's folder, built on first use.
    """
    from infra.lmeval import run_lmeval_recorded

    if not tasks:
        return EvalResult(results={})
    if not include_path and (kit := kit_tasks_dir(tasks)) is not None:
        include_path = str(kit)
    net, tokenizer = load_model(model, runtime, keep_slot=True)
    results, provenance = run_lmeval_recorded(ensure_local(model), list(tasks),
                                              include_path=Path(include_path) if include_path else None, limit=limit,
                                              loaded=(net, tokenizer), device=str(next(net.parameters()).device))
    log.info("evaluate: %s", results)
    return EvalResult(results=results, provenance=provenance)


@task(name="eval-provenance")
def eval_provenance(model: ModelRef, calib: CalibrationRef, final: EvalResult, dense: EvalResult) -> dict:
    """The provenance record of the run's figures: both lm-eval runs and the held-out set (digest, tokens).

    The held-out texts are those of the quick eval (perplexity, KL / top-1 / ppl ratio to the dense
    model), tokenized as the quick eval does (truncated to `calib.max_length`) by the tokenizer of
    `model`, the model in hand: every pipprune output carries its source's tokenizer byte for byte, and
    reading a second copy from disk cost 30 MB at the run's peak on SmolLM2-135M.
    """
    texts = read_heldout(calib)
    _, tokenizer = load_model(model, keep_slot=True)
    heldout = provenance.heldout_record(tokenizer, texts, calib.max_length, "calibration held-out texts (heldout_samples)") \
        if texts else None
    runs = {role: r.provenance for role, r in (("final", final), ("source", dense)) if r.provenance}
    return provenance.build(runs, heldout)
