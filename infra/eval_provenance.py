"""What produced an evaluation figure, recorded so the figure can be recomputed exactly.

The same model's perplexity can differ 2x between two scripts (another sequence length, another
few-shot count, acc vs acc_norm, another copy of the data). Every figure the pipeline reports is
therefore stored with a provenance record: the lm-eval version, each task's name, version,
few-shot count, metrics (with lm-eval's filter, e.g. `acc,none` vs `acc_norm,none`), the documents
it used (limit, and the sha256 of each local data file), the sequence length the harness truncated
to, and for the held-out metrics (perplexity, KL / top-1 agreement / ppl ratio to the dense model)
the sha256 of the held-out texts, their number of documents and predicted tokens and the window.

The record carries content digests, never machine paths, so the same evaluation on another
machine gives the same record and the same digest. Pure functions: no MLflow, no Prefect.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from infra.tags import EVAL_PREFIX

SCHEMA = 1
#: the MLflow artifact holding the full record
ARTIFACT = "eval_provenance.json"
#: MLflow caps a tag value (5000 chars for model version tags); the full record is in the artifact
_TAG_MAX = 4000


def lm_eval_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("lm_eval", "lm-eval"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _data_files(kwargs: dict | None) -> dict[str, dict[str, str]]:
    """{split: {"name": file name, "sha256": ...}} for local data files of a task (URLs and hub data: name only)."""
    files = (kwargs or {}).get("data_files") or {}
    if isinstance(files, (str, list)):
        files = {"data": files}
    out: dict[str, dict[str, str]] = {}
    for split, spec in sorted(files.items()):
        paths = [spec] if isinstance(spec, str) else list(spec)
        digests = []
        for p in paths:
            path = Path(p)
            digests.append(_sha256(path.read_bytes()) if path.is_file() else f"unresolved:{p}")
        out[split] = {"name": ",".join(Path(p).name for p in paths), "sha256": ",".join(digests)}
    return out


def _task_config_digest(config: dict) -> str:
    """sha256 of the task's resolved config without machine-dependent paths (data files are hashed apart)."""
    clean = {k: v for k, v in config.items() if k not in ("dataset_kwargs", "metadata")}
    meta = {k: v for k, v in (config.get("metadata") or {}).items() if k != "config_source"}
    return _sha256(json.dumps([clean, meta], sort_keys=True, default=str).encode())


def lmeval_record(raw: dict[str, Any], max_length: int, batch_size: int | None, limit: int | float | None) -> dict:
    """The provenance of one `simple_evaluate` result (`raw`), run with an HFLM of `max_length` tokens."""
    configs = raw.get("configs") or {}
    versions, shots = raw.get("versions") or {}, raw.get("n-shot") or {}
    samples = raw.get("n-samples") or {}
    tasks = {}
    for name in sorted(raw.get("results") or {}):
        cfg = configs.get(name) or {}
        reported = sorted(k for k, v in raw["results"][name].items()
                          if "," in k and not k.split(",")[0].endswith("_stderr") and isinstance(v, (int, float)))
        tasks[name] = {
            "version": versions.get(name),
            "num_fewshot": shots.get(name, cfg.get("num_fewshot")),
            "output_type": cfg.get("output_type"),
            "metrics": [m.get("metric") for m in cfg.get("metric_list") or [] if isinstance(m, dict)],
            "reported": reported,  # metric,filter as lm-eval keys them: acc,none vs acc_norm,none
            "dataset": {"path": cfg.get("dataset_path"), "name": cfg.get("dataset_name"),
                        "revision": (cfg.get("dataset_kwargs") or {}).get("revision"),
                        "files": _data_files(cfg.get("dataset_kwargs"))},
            "split": cfg.get("test_split") or cfg.get("validation_split"),
            "documents": (samples.get(name) or {}).get("effective"),
            "config_sha256": _task_config_digest(cfg),
        }
    run = raw.get("config") or {}
    return {"harness": "lm-eval", "version": lm_eval_version(), "max_length": int(max_length),
            "batch_size": batch_size, "limit": limit, "bootstrap_iters": run.get("bootstrap_iters"),
            "seeds": {k: run.get(k) for k in ("random_seed", "numpy_seed", "torch_seed", "fewshot_seed")},
            "model_dtype": str(run.get("model_dtype")), "tasks": tasks}


def heldout_record(tokenizer, texts: Sequence[str], max_length: int, source: str,  # noqa: ANN001
                   chunk_tokens: int | None = None) -> dict:
    """The held-out set behind perplexity and the KL / top-1 / ppl-ratio figures: digest, documents, tokens."""
    payload = json.dumps(list(texts), ensure_ascii=False).encode()
    tokens = sum(max(len(tokenizer(t, truncation=True, max_length=max_length)["input_ids"]) - 1, 0) for t in texts)
    return heldout_figures(source, _sha256(payload), len(texts), tokens, max_length, chunk_tokens)


def heldout_figures(source: str, sha256: str, documents: int, tokens: int, max_length: int,
                    chunk_tokens: int | None = None) -> dict:
    """The held-out record's shape, shared by the flow (`heldout_record`) and `pipprune eval --reference`."""
    out = {"source": source, "sha256": sha256, "documents": int(documents), "tokens": int(tokens),
           "max_length": int(max_length), "kl": "mean per predicted token of KL(dense || model), natural log",
           "ppl_ratio": "exp(mean NLL model - mean NLL dense) over the same tokens"}
    if chunk_tokens is not None:
        out["chunk_tokens"] = int(chunk_tokens)
    return out


def build(lm_eval: dict[str, dict] | None, heldout: dict | None) -> dict:
    """The full record: lm-eval runs by model role ("final", "source") and the held-out set."""
    return {"schema": SCHEMA, "lm_eval": lm_eval or {}, "heldout": heldout}


def digest(record: dict) -> str:
    """sha256 of the canonical JSON of the record (what the version's tag names)."""
    return _sha256(json.dumps(record, sort_keys=True, default=str).encode())


def _task_summary(tasks: dict[str, dict]) -> str:
    parts = []
    for name, t in sorted(tasks.items()):
        metrics = "/".join(t.get("reported") or t.get("metrics") or [])
        parts.append(f"{name}@v{t.get('version')}:{t.get('num_fewshot')}-shot:{metrics}")
    text = ";".join(parts)
    return text if len(text) <= _TAG_MAX else text[:_TAG_MAX - 3] + "..."


def tags(record: dict) -> dict[str, str]:
    """Compact tags for the run and the registered version: the record's digest plus its key fields."""
    out = {f"{EVAL_PREFIX}provenance_sha256": digest(record), f"{EVAL_PREFIX}schema": str(record.get("schema"))}
    runs = record.get("lm_eval") or {}
    first = runs.get("final") or next(iter(runs.values()), None)
    if first:
        out.update({f"{EVAL_PREFIX}lm_eval_version": str(first["version"]),
                    f"{EVAL_PREFIX}tasks": _task_summary(first["tasks"]),
                    f"{EVAL_PREFIX}limit": str(first["limit"]), f"{EVAL_PREFIX}max_length": str(first["max_length"])})
        data = sorted({f["sha256"] for t in first["tasks"].values() for f in t["dataset"]["files"].values()})
        if data:
            out[f"{EVAL_PREFIX}data_sha256"] = _sha256(",".join(data).encode())
    held = record.get("heldout")
    if held:
        out.update({f"{EVAL_PREFIX}heldout_sha256": held["sha256"], f"{EVAL_PREFIX}heldout_tokens": str(held["tokens"]),
                    f"{EVAL_PREFIX}heldout_documents": str(held["documents"]),
                    f"{EVAL_PREFIX}heldout_max_length": str(held["max_length"])})
    return out
