"""Reconstruct and re-verify where a registered model version came from, from MLflow and S3 alone.

Checks, each reported by name: the version's tags agree with its MLflow run's tags; every
iteration's manifest exists; every file's sha256 in S3 matches its manifest; the registered
fingerprint and manifest hash match the final checkpoint; per-iteration metrics in S3 match
those logged in MLflow; with a verifier, the final model's OpenSSF signature verifies with the
given public key against the bytes now in S3.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from infra import tags as tag_names
from infra.gguf_store import ExportRecord, is_export, trace_export
from infra.signing import SignatureCheck


class LineageError(ValueError):
    """The version cannot be found or carries no pipprune lineage."""


class IterationRecord(BaseModel):
    iteration: int
    stage: str = "prune"  # "prune", or "recovery" for the LoRA / KD stage after the last pruning step
    #: recovery by distillation: the teacher's fingerprint (lineage checks it is the source model)
    teacher_fingerprint: str | None = None
    s3_uri: str
    num_params: int | None
    achieved_ratio: float | None
    units_removed: int
    metrics: dict[str, float]
    files_verified: int


class Lineage(BaseModel):
    name: str
    version: str
    source_model: str
    source_fingerprint: str
    calibration_hash: str
    config_digest: str
    code_digest: str
    git_sha: str
    prefect_flow_run_id: str
    mlflow_run_id: str
    final_s3_uri: str
    config: dict[str, Any]
    iterations: list[IterationRecord]
    signature: SignatureCheck | None = None  # None: not checked (the caller passed no verifier)
    problems: list[str]
    #: the run's MLflow dataset inputs by context ("calibration", "evaluation"): digest, source, name
    datasets: dict[str, dict[str, str]] = {}
    logged_model_id: str | None = None
    #: a GGUF child version: its file and parent; the fields above are then the parent's chain (infra.gguf_store)
    export: ExportRecord | None = None
    parent_signature: SignatureCheck | None = None
    #: a GGUF source: file, sha256, quant_types, and `checked` (re-hashed here) / `present` (found on this machine)
    source_gguf: dict[str, Any] | None = None
    #: a vocabulary trimmed before pruning: corpus, its sha256, tokens, the kept ids' sha256, the trimmed dense
    #: model's fingerprint, and `checked` (its copy in this machine's cache re-hashed) / `present`
    vocab: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def resolve_version(client, name: str, version: str | None) -> Any:  # noqa: ANN001
    from mlflow.exceptions import MlflowException

    try:
        if version is None:
            versions = client.search_model_versions(f"name = '{name}'")
            if not versions:
                raise LineageError(f"registered model {name!r} has no versions")
            return max(versions, key=lambda v: int(v.version))
        if not str(version).isdigit():
            return client.get_model_version_by_alias(name, version)
        return client.get_model_version(name, str(version))
    except MlflowException as exc:
        raise LineageError(f"registered model {name!r} version {version!r} not found") from exc


def trace(client, store_for_run_key, name: str, version: str | None = None,  # noqa: ANN001
          verify_signature: Callable[[dict[str, str], Any], SignatureCheck] | None = None) -> Lineage:
    """Build the lineage of `name`/`version`; `store_for_run_key(run_key)` gives the S3 checkpoint store.

    `verify_signature(tags, store)` checks the version's model signature (infra.signing), whose
    problems join the others: the hashes alone cannot catch a bucket writer who rewrote the manifest too.
    """
    mv = resolve_version(client, name, version)
    tags = dict(mv.tags)
    if is_export(tags):  # a GGUF child: its own file and signature, then the parent's whole chain
        return trace_export(client, mv, store_for_run_key, lambda n, v, verify: trace(
            client, store_for_run_key, n, v, verify), verify_signature)
    if tag_names.RUN_KEY not in tags:
        raise LineageError(f"{name} v{mv.version} was not registered by pipprune (no pipprune.run_key tag)")
    problems: list[str] = []
    run_id = tags.get(tag_names.MLFLOW_RUN_ID, mv.run_id or "")
    if mv.run_id and run_id != mv.run_id:
        problems.append(f"tag pipprune.mlflow_run_id={run_id} but the version's run is {mv.run_id}")
    run = client.get_run(run_id)
    for key in tag_names.LINEAGE:
        if tags.get(key) != run.data.tags.get(key):
            problems.append(f"tag {key}: version says {tags.get(key)!r}, MLflow run says {run.data.tags.get(key)!r}")
    config = {k: v for k, v in run.data.params.items()}
    history = {m: {h.step: h.value for h in client.get_metric_history(run_id, m)}
               for m in ("num_params", "achieved_ratio", "heldout_perplexity")}

    store = store_for_run_key(tags[tag_names.RUN_KEY])
    iterations: list[IterationRecord] = []
    expected = int(tags.get(tag_names.FINAL_CHECKPOINT, tags.get(tag_names.ITERATIONS, "0")))
    refs = {ref.iteration: ref for ref in store.complete_checkpoints()}
    for i in range(1, expected + 1):
        ref = refs.get(i)
        if ref is None:
            problems.append(f"iteration {i}: no complete checkpoint (manifest) in S3")
            continue
        mismatches = store.verify_checkpoint(ref)
        problems.extend(f"iteration {i}: {m}" for m in mismatches)
        meta = ref.metadata
        metrics = {k: float(v) for k, v in meta.get("metrics", {}).items()}
        for metric, steps in history.items():
            if metric in metrics and i in steps and abs(steps[i] - metrics[metric]) > 1e-6 * max(1.0, abs(steps[i])):
                problems.append(f"iteration {i}: {metric} in S3 is {metrics[metric]} but MLflow logged {steps[i]}")
        if meta.get("lineage", {}).get(tag_names.RUN_KEY) not in (None, tags[tag_names.RUN_KEY]):
            problems.append(f"iteration {i}: manifest belongs to run key {meta['lineage'][tag_names.RUN_KEY]}")
        problems.extend(_check_recovery(i, meta, refs.get(i - 1), tags))
        iterations.append(IterationRecord(
            iteration=i, stage=meta.get("stage", "prune"), s3_uri=ref.uri,
            teacher_fingerprint=meta.get("teacher_fingerprint"),
            num_params=metrics.get("num_params") and int(metrics["num_params"]),
            achieved_ratio=metrics.get("achieved_ratio"), units_removed=len(meta.get("units_removed", [])),
            metrics=metrics, files_verified=len(ref.files) - len(mismatches)))
    final = refs.get(expected)
    if final is not None:
        if final.manifest_sha256 != tags.get(tag_names.MANIFEST_SHA256):
            problems.append(f"final manifest sha256 {final.manifest_sha256[:12]} != registered "
                            f"{tags.get('pipprune.manifest_sha256', '')[:12]}")
        if final.metadata.get("model_fingerprint") != tags.get(tag_names.MODEL_FINGERPRINT):
            problems.append("final model fingerprint in S3 differs from the registered one")
        if not (tags.get(tag_names.S3_URI) or "").startswith(final.uri):
            problems.append(f"registered S3 URI {tags.get('pipprune.s3_uri')} is not under {final.uri}")
        problems.extend(_check_mlflow_model(mv, tags, final, store))
    datasets = run_datasets(run)
    problems.extend(_check_datasets(datasets, tags))
    source_gguf = _check_gguf_source(tags, problems)
    vocab = _check_vocab(tags, problems)
    signature = verify_signature(tags, store) if verify_signature is not None else None
    if signature is not None:
        problems.extend(signature.problems)
    return Lineage(
        signature=signature, name=name, version=str(mv.version), source_model=tags.get(tag_names.SOURCE_MODEL, ""),
        source_fingerprint=tags.get(tag_names.SOURCE_FINGERPRINT, ""),
        calibration_hash=tags.get(tag_names.CALIBRATION_HASH, ""), config_digest=tags.get(tag_names.CONFIG_DIGEST, ""),
        code_digest=tags.get(tag_names.CODE_DIGEST, ""), git_sha=tags.get(tag_names.GIT_SHA, ""),
        prefect_flow_run_id=tags.get(tag_names.PREFECT_FLOW_RUN_ID, ""), mlflow_run_id=run_id,
        final_s3_uri=tags.get(tag_names.S3_URI, ""), config=config, iterations=iterations, problems=problems,
        datasets=datasets, logged_model_id=tags.get(tag_names.LOGGED_MODEL_ID) or getattr(mv, "model_id", None),
        source_gguf=source_gguf, vocab=vocab)


def _check_vocab(tags: dict[str, str], problems: list[str]) -> dict[str, Any] | None:
    """A trimmed vocabulary re-checked where its trimmed copy lies (this machine's cache, named by the source's
    fingerprint and the corpus's sha256): the copy's fingerprint and its kept ids' sha256 must be the recorded ones.
    Elsewhere it is reported as not checked, not as a mismatch."""
    from infra.settings import Settings
    from infra.vocab_source import recorded_copy

    if not tags.get(tag_names.VOCAB_KEPT_SHA256):
        return None
    copy = recorded_copy(tags, Settings().home / "cache")
    if copy.mismatch:
        problems.append(f"trimmed vocabulary at {copy.path}: {copy.mismatch}")
    return {"corpus": tags.get(tag_names.VOCAB_CORPUS), "tokens": tags.get(tag_names.VOCAB_TOKENS),
            "corpus_sha256": tags.get(tag_names.VOCAB_CORPUS_SHA256), "kept_sha256": tags[tag_names.VOCAB_KEPT_SHA256],
            "dense_fingerprint": tags.get(tag_names.VOCAB_DENSE_FINGERPRINT), "present": copy.present,
            "checked": copy.usable}


def _check_gguf_source(tags: dict[str, str], problems: list[str]) -> dict[str, Any] | None:
    """A GGUF source re-hashed where it still lies (the source_model path): its sha256 must be the recorded one.

    Elsewhere (another machine) the file cannot be read and is reported as not checked, not as a mismatch.
    """
    from pathlib import Path

    from infra.hashing import sha256_file

    recorded = tags.get(tag_names.SOURCE_GGUF_SHA256)
    if not recorded:
        return None
    path = Path(tags.get(tag_names.SOURCE_GGUF_PATH) or tags.get(tag_names.SOURCE_MODEL, ""))
    info: dict[str, Any] = {"file": tags.get(tag_names.SOURCE_GGUF_FILE), "path": str(path), "sha256": recorded,
                            "quant_types": tags.get(tag_names.SOURCE_GGUF_QUANT_TYPES), "present": path.is_file(),
                            "checked": False}
    if path.is_file():
        actual = sha256_file(path)
        info["checked"] = actual == recorded
        if actual != recorded:
            problems.append(f"source GGUF {path}: sha256 {actual[:16]} != recorded {recorded[:16]} (the file changed)")
    return info


def run_datasets(run) -> dict[str, dict[str, str]]:  # noqa: ANN001
    """The run's dataset inputs keyed by their `mlflow.data.context` tag."""
    found: dict[str, dict[str, str]] = {}
    for item in getattr(run.inputs, "dataset_inputs", None) or []:
        context = next((t.value for t in item.tags if t.key == "mlflow.data.context"), "")
        found[context] = {"name": item.dataset.name, "digest": item.dataset.digest, "source": item.dataset.source,
                          "source_type": item.dataset.source_type}
    return found


def _check_datasets(datasets: dict[str, dict[str, str]], tags: dict[str, str]) -> list[str]:
    """Version tags pipprune.dataset.<context>.digest must match the run's inputs; calibration matches its hash."""
    problems = []
    for key, digest in tags.items():
        if not (key.startswith(tag_names.DATASET_PREFIX) and key.endswith(".digest")):
            continue
        context = key[len(tag_names.DATASET_PREFIX):-len(".digest")]
        logged = datasets.get(context, {}).get("digest")
        if logged != digest:
            problems.append(f"dataset {context}: version says digest {digest}, the run's input says {logged}")
    calibration = tags.get(tag_names.DATASET_DIGEST.format(context="calibration"))
    if calibration and not tags.get(tag_names.CALIBRATION_HASH, "").startswith(calibration):
        problems.append(f"dataset calibration: digest {calibration} is not the calibration hash "
                        f"{tags.get(tag_names.CALIBRATION_HASH, '')[:32]}")
    return problems


def _check_mlflow_model(mv, tags: dict[str, str], final, store) -> list[str]:  # noqa: ANN001
    """A version registered as an MLflow model: its source is the final checkpoint, its files hash as listed."""
    import json

    from infra.hashing import sha256_bytes
    from infra.mlflow_model import FILES_MANIFEST
    from infra.s3store import split_uri

    expected = tags.get(tag_names.MLFLOW_FILES_SHA256)
    if expected is None:
        return []  # registered before versions were MLflow models: nothing more to check
    problems = []
    if mv.source.rstrip("/") != final.uri.rstrip("/"):
        problems.append(f"version source {mv.source} is not the final checkpoint {final.uri}")
    _, base = split_uri(final.uri)
    try:
        body = store.client.get_object(Bucket=store.bucket, Key=base + FILES_MANIFEST)["Body"].read()
    except store.client.exceptions.NoSuchKey:
        return [*problems, f"{final.uri}{FILES_MANIFEST}: missing (the MLflow model files are not listed)"]
    if sha256_bytes(body) != expected:
        problems.append(f"{final.uri}{FILES_MANIFEST}: sha256 {sha256_bytes(body)[:12]} != registered {expected[:12]}")
    for rel, digest in sorted(json.loads(body).items()):
        try:
            data = store.client.get_object(Bucket=store.bucket, Key=base + rel)["Body"].read()
        except store.client.exceptions.NoSuchKey:
            problems.append(f"{final.uri}{rel}: missing")
            continue
        if sha256_bytes(data) != digest:
            problems.append(f"{final.uri}{rel}: sha256 {sha256_bytes(data)[:12]} != listed {digest[:12]}")
    return problems


def _check_recovery(i: int, meta: dict, previous, tags: dict[str, str]) -> list[str]:  # noqa: ANN001
    """A recovery stage continues the last pruned model, and a distilled one names the source as its teacher."""
    if meta.get("stage") != "recovery":
        return []
    problems = []
    if previous is not None and meta.get("pruned_model_fingerprint") != previous.metadata.get("model_fingerprint"):
        problems.append(f"iteration {i}: recovery started from {str(meta.get('pruned_model_fingerprint'))[:12]}, "
                        f"not the checkpoint of step {i - 1}")
    # the teacher is the run's dense model: the source, or its vocabulary-trimmed copy when the run trimmed one
    dense = tags.get(tag_names.VOCAB_DENSE_FINGERPRINT) or tags.get(tag_names.SOURCE_FINGERPRINT, "")
    if (meta.get("recovery") or {}).get("kind") == "kd" and meta.get("teacher_fingerprint") != dense:
        problems.append(f"iteration {i}: distilled from teacher {str(meta.get('teacher_fingerprint'))[:12]}, "
                        f"not the source model {dense[:12]}")
    return problems
