"""Export tasks: a registered version -> a GGUF file -> measured -> in S3 beside its parent -> signed -> a child version.

The child is a version of a linked registered model (default `<NAME>-gguf`), so `models:/NAME@alias` keeps
meaning a transformers model while the GGUF versions are promoted and audited on their own.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import task
from pydantic import BaseModel, ConfigDict

from infra.gguf_store import FORMAT, INHERITED, TAGS, PublishedGguf
from infra.mlflow_utils import mlflow_client
from infra.settings import Settings
from infra.tags import (
    GGUF_FILE_TYPE,
    HELDOUT_SHA256,
    MANIFEST_SHA256,
    MLFLOW_RUN_ID,
    MODEL_FINGERPRINT,
    S3_URI,
    SOURCE_FINGERPRINT,
    SOURCE_MODEL,
    VOCAB_CORPUS,
    VOCAB_DENSE_FINGERPRINT,
)
from tasks._common import RETRIES, RETRY_DELAYS, retry_transient
from tasks.refs import ModelRef, SignatureRef
from tasks.signing import sign_stored

log = logging.getLogger(__name__)

#: MLflow tag that nests the export's run under the run of the compress job that made its parent
PARENT_RUN_TAG = "mlflow.parentRunId"


class _Ref(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ParentRef(_Ref):
    """A registered (transformers) version to export, with the dense model it was pruned from."""

    name: str
    version: str
    run_id: str
    model: ModelRef
    dense: ModelRef
    tags: dict[str, str]


class GgufRef(_Ref):
    """A GGUF file on local disk (alone in its folder: the folder is what gets signed)."""

    path: str
    sha256: str
    quant: str
    info: dict


class ExportSummary(BaseModel):
    """What one export produced (the `pipprune export --json` document)."""

    registered_model: str
    model_version: str
    parent: str
    quant: str
    file: str
    sha256: str
    size_bytes: int
    s3_uri: str
    signature_uri: str
    mlflow_run_id: str
    tensor_types: dict[str, int]
    fallbacks: list[str]
    metrics: dict[str, float]
    #: the file's own quality verdict (flows.records.quality_verdict on its final.* figures)
    quality: dict = {}


def gguf_name(parent: ParentRef, quant: str) -> str:
    return f"{parent.name}-v{parent.version}-{quant}.gguf"


@task(name="resolve-parent", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def resolve_parent(name: str, version: str) -> ParentRef:
    """The registered version and its dense source: the version's model fetched from S3 (verified against its
    manifest), the source re-fingerprinted against the version's tag."""
    from infra.gguf_store import is_export
    from infra.lineage import LineageError, resolve_version
    from infra.model_source import local_model_dir
    from pip_core import io as core_io
    from tasks.models import ensure_local

    client = mlflow_client()
    mv = resolve_version(client, name, version)
    tags = dict(mv.tags)
    if is_export(tags):
        raise LineageError(f"{name} v{mv.version} is itself a GGUF export; export its parent "
                           f"{tags.get(TAGS['parent_name'])} v{tags.get(TAGS['parent_version'])}")
    if not tags.get(S3_URI) or not tags.get(MODEL_FINGERPRINT):
        raise LineageError(f"{name} v{mv.version} was not registered by pipprune compress (no S3 checkpoint tags)")
    settings = Settings()
    fingerprint = tags[MODEL_FINGERPRINT]
    model = ModelRef(local_dir=str(settings.work_dir / "models" / f"registered-{fingerprint[:20]}"),
                     fingerprint=fingerprint, num_params=0, s3_uri=tags[S3_URI],
                     manifest_sha256=tags.get(MANIFEST_SHA256))
    local = ensure_local(model, settings)
    model = model.model_copy(update={"num_params": core_io.param_count_from_dir(local)})
    source = local_model_dir(tags.get(SOURCE_MODEL, ""))
    source_fp = core_io.model_fingerprint(source)
    if source_fp != tags.get(SOURCE_FINGERPRINT):
        raise LineageError(f"dense source {source} has fingerprint {source_fp[:12]}, the version was pruned from "
                           f"{tags.get(SOURCE_FINGERPRINT, '')[:12]}: not the same model")
    if tags.get(VOCAB_DENSE_FINGERPRINT):  # the run pruned the source's vocabulary-trimmed copy: that is the dense
        source = _trimmed_dense(tags, settings)
    dense = ModelRef(local_dir=str(source), fingerprint=core_io.model_fingerprint(source),
                     num_params=core_io.param_count_from_dir(source))
    return ParentRef(name=name, version=str(mv.version), run_id=mv.run_id or "", model=model, dense=dense, tags=tags)


def _trimmed_dense(tags: dict[str, str], settings: Settings) -> Path:
    """The vocabulary-trimmed dense model a version was pruned from, from the cache it was written to (its place is
    named by the source's fingerprint and the corpus's sha256, both in the version's tags)."""
    from infra.lineage import LineageError
    from infra.vocab_source import recorded_copy

    copy = recorded_copy(tags, settings.home / "cache")
    if not copy.usable:
        state = f"not it: {copy.mismatch}" if copy.mismatch else "not there"
        raise LineageError(f"the version was pruned from the source's vocabulary trimmed to {tags.get(VOCAB_CORPUS)} "
                           f"(dense fingerprint {tags[VOCAB_DENSE_FINGERPRINT][:12]}), and the copy at {copy.path} is "
                           f"{state}: run compress with the same --vocab-corpus on this machine first")
    return copy.path


@task(name="parent-of-run")
def parent_of_run(name: str, version: str, run_id: str, model: ModelRef, dense: ModelRef) -> ParentRef:
    """The version the compress flow just registered, as the export's parent (its models are already at hand)."""
    tags = dict(mlflow_client().get_model_version(name, version).tags)
    return ParentRef(name=name, version=version, run_id=run_id, model=model, dense=dense, tags=tags)


@task(name="check-exportable")
def check_exportable_source(source: ModelRef, quants: tuple[str, ...]) -> None:
    """Before any work: the source's family, tokenizer and config can be written as GGUF (the pruned model keeps
    them; a pruned shape GGUF cannot state is still refused when the export runs)."""
    from infra.gguf_write import check_exportable

    for quant in quants:
        check_exportable(Path(source.local_dir), quant)


@task(name="write-gguf")
def write_gguf_file(model: ModelRef, quant: str, file_name: str) -> GgufRef:
    """The model as a GGUF file under the state dir (content-addressed folder: parent fingerprint and type)."""
    from infra.gguf_write import write_gguf
    from tasks.models import ensure_local

    out = Settings().work_dir / "exports" / f"{model.fingerprint[:20]}-{quant}" / file_name
    info = write_gguf(ensure_local(model), out, quant, name=Path(file_name).stem)
    for other in out.parent.iterdir():  # the folder holds exactly the file it signs
        if other != out:
            other.unlink()
    log.info("wrote %s: %s, %.1f MB, %s", out, info.file_type, info.size_bytes / 1e6, info.tensor_types)
    return GgufRef(path=str(out), sha256=info.sha256, quant=info.quant, info=info.as_dict())


def read_back(path: Path):  # noqa: ANN201 - (PreTrainedModel, tokenizer)
    """The GGUF file as transformers' own GGUF loader rebuilds it (float32): an independent reader of our writer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@task(name="measure-gguf")
def measure_gguf(gguf: GgufRef, parent: ModelRef, dense: ModelRef, heldout: str, max_length: int) -> dict[str, float]:
    """The exported file's quality on held-out text, read back by transformers' GGUF loader (see `gguf_quality`)."""
    from pip_core.divergence import read_texts
    from tasks.models import load_model

    dense_net, tokenizer = load_model(dense, keep_slot=True, seq_len=max_length)
    parent_net, _ = load_model(parent, seq_len=max_length)
    out = gguf_quality(dense_net, parent_net, tokenizer, Path(gguf.path), read_texts(Path(heldout)), max_length)
    out["gguf.size_bytes"] = float(gguf.info["size_bytes"])
    log.info("GGUF %s: KL to dense %.4f (parent %.4f), top-1 %.3f, ppl ratio %.3f; tokenizer match %.2f",
             gguf.quant, out["final.heldout_kl"], out["parent.heldout_kl"], out["final.heldout_top1_agreement"],
             out["final.heldout_ppl_ratio"], out["gguf.tokenizer_match"])
    return out


def gguf_quality(dense_net, parent_net, tokenizer, path: Path, texts: list[str],  # noqa: ANN001
                 max_length: int) -> dict[str, float]:
    """final.*: the file (as transformers' GGUF loader rebuilds it) against the dense model: KL, top-1 agreement,
    perplexity ratio, perplexity; parent.*: the parent checkpoint on the same texts; gguf.kl_to_parent /
    top1_to_parent: what the weight type alone changed; gguf.tokenizer_match: share of texts the file's own
    tokenizer encodes to the parent's ids."""
    from pip_core.divergence import doc_stats, encode

    file_net, file_tok = read_back(path)
    file_net.to(next(dense_net.parameters()).device)
    ours, theirs = encode(tokenizer, texts, max_length), encode(file_tok, texts, max_length)
    match = sum(a.tolist() == b.tolist() for a, b in zip(ours, theirs, strict=True)) / len(texts)
    out: dict[str, float] = {"gguf.tokenizer_match": match, "heldout.documents": float(len(texts)),
                             "heldout.max_length": float(max_length)}
    for prefix, net in (("final", file_net), ("parent", parent_net)):
        m = doc_stats(dense_net, net, tokenizer, texts, max_length=max_length).metrics()
        out.update({f"{prefix}.heldout_kl": m["kl"], f"{prefix}.heldout_top1_agreement": m["top1_agreement"],
                    f"{prefix}.heldout_ppl_ratio": m["ppl_ratio"], f"{prefix}.heldout_perplexity": m["ppl_pruned"]})
        out["source.heldout_perplexity"], out["heldout.tokens"] = m["ppl_dense"], m["tokens"]
    q = doc_stats(parent_net, file_net, tokenizer, texts, max_length=max_length).metrics()
    out.update({"gguf.kl_to_parent": q["kl"], "gguf.top1_to_parent": q["top1_agreement"]})
    return out


@task(name="publish-gguf", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def publish_gguf(gguf: GgufRef, parent: ParentRef, metrics: dict[str, float]) -> PublishedGguf:
    """Upload the file beside the parent's checkpoint in S3, then its manifest (sha256, parent, measurement)."""
    from infra import gguf_store
    from infra.s3store import CheckpointStore

    store = CheckpointStore.for_uri(Settings(), parent.model.s3_uri or "")
    metadata = {"parent": {"name": parent.name, "version": parent.version, "fingerprint": parent.model.fingerprint,
                           "manifest_sha256": parent.model.manifest_sha256},
                "dense": {"source_model": parent.tags.get(SOURCE_MODEL), "fingerprint": parent.dense.fingerprint},
                "gguf": gguf.info, "metrics": metrics}
    return gguf_store.publish(store, Path(gguf.path), gguf.quant, parent.model.s3_uri or "", metadata)


@task(name="sign-gguf", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def sign_gguf(gguf: GgufRef, published: PublishedGguf) -> SignatureRef:
    """OpenSSF model signature of the export's folder, beside it in S3 (as sign_checkpoint does for checkpoints)."""
    from infra.s3store import CheckpointStore

    settings = Settings()
    store = CheckpointStore.for_uri(settings, published.uri)
    return sign_stored(store, published.uri, Path(gguf.path).parent, {published.file: published.sha256}, settings)


def child_tags(parent: ParentRef, gguf: GgufRef, published: PublishedGguf, signature: SignatureRef,
               heldout: str) -> dict[str, str]:
    """The child version's tags: format, type, digest, parent, the parent's lineage roots, S3 and signature."""
    from infra.hashing import sha256_file

    return {FORMAT: "gguf", TAGS["quant"]: gguf.quant, TAGS["sha256"]: published.sha256, TAGS["file"]: published.file,
            TAGS["manifest_uri"]: published.manifest_uri, TAGS["manifest_sha256"]: published.manifest_sha256,
            TAGS["parent_name"]: parent.name, TAGS["parent_version"]: parent.version,
            TAGS["parent_fingerprint"]: parent.model.fingerprint,
            TAGS["parent_manifest_sha256"]: parent.tags.get(MANIFEST_SHA256, ""),
            **{k: parent.tags.get(k, "") for k in INHERITED},
            S3_URI: published.uri, HELDOUT_SHA256: sha256_file(heldout),
            GGUF_FILE_TYPE: str(gguf.info.get("file_type")), **signature.tags()}


@task(name="register-gguf", retries=RETRIES, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=retry_transient)
def register_gguf(name: str, parent: ParentRef, tags: dict[str, str], metrics: dict[str, float],
                  params: dict[str, str]) -> tuple[str, str]:
    """(version, run id): the child version of `name`, with an MLflow run (nested under the parent's) holding the
    measured metrics; a rerun with the same parent, type and file digest returns the version already there."""
    from mlflow.entities import Metric, Param, RunStatus

    from tasks.registry import _ensure_registered_model
    from tasks.tracking import experiment_id

    client = mlflow_client()
    _ensure_registered_model(client, name)
    wanted = (parent.name, parent.version, tags[TAGS["quant"]], tags[TAGS["sha256"]])
    for mv in client.search_model_versions(f"name = '{name}'"):
        if tuple(mv.tags.get(TAGS[k]) for k in ("parent_name", "parent_version", "quant", "sha256")) == wanted:
            log.info("%s version %s already registered for this file", name, mv.version)
            return str(mv.version), mv.run_id or ""
    parent_metrics = client.get_run(parent.run_id).data.metrics if parent.run_id else {}
    carried = {k: v for k, v in parent_metrics.items()  # the pruning's own figures, for the usual gates
               if k in ("final.achieved_ratio", "final.num_params", "source.num_params") or k.startswith("source.")}
    experiment = client.get_run(parent.run_id).info.experiment_id if parent.run_id else experiment_id(client)
    run = client.create_run(experiment, run_name=f"export-{tags[TAGS['quant']]}-{parent.name}-v{parent.version}",
                            tags={**tags, **({PARENT_RUN_TAG: parent.run_id} if parent.run_id else {})})
    run_id = run.info.run_id
    try:
        import time

        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in {**carried, **metrics}.items()],
                         params=[Param(k, str(v)) for k, v in params.items()])
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))
    except BaseException:
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))
        raise
    version = client.create_model_version(
        name, source=tags[S3_URI], run_id=run_id, tags={**tags, MLFLOW_RUN_ID: run_id},
        description=f"GGUF ({tags[TAGS['quant']]}) of {parent.name} v{parent.version}: {tags[S3_URI]}")
    log.info("registered %s version %s (GGUF of %s v%s)", name, version.version, parent.name, parent.version)
    return str(version.version), run_id
