"""A pipprune checkpoint as an MLflow model (transformers flavor) without a second copy of its weights.

MLflow's transformers flavor reads the weights from `<model root>/model` (`model_binary: model`),
and a pipprune checkpoint already keeps its Hugging Face directory at `iter-<N>/model/`. So the
final checkpoint's prefix *is* the MLflow model once the flavor's small files sit beside it:

    s3://BUCKET/runs/<run_key>/iter-<N>/
        model/...                 weights, config, tokenizer (the checkpoint; in manifest.json)
        manifest.json, score_table.csv
        MLmodel, requirements.txt, python_env.yaml, conda.yaml,
        input_example.json, serving_input_example.json,
        components/tokenizer/...  written by `build` at registration
        mlflow_files.json         sha256 of each file above (its own sha256 is a version tag)

The registered version's source is that prefix, so `mlflow.transformers.load_model`,
`mlflow.pyfunc.load_model` and `mlflow models serve` read the very bytes lineage verifies.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from infra.hashing import sha256_bytes, sha256_dir
from infra.tags import REMOTE_CODE, REQUIRES_REMOTE_CODE, WEIGHTS

log = logging.getLogger(__name__)

MODEL_SUBDIR = "model"
FILES_MANIFEST = "mlflow_files.json"
TASK = "text-generation"
#: the signature's inference parameters (defaults apply when a request gives none)
INFERENCE_PARAMS: dict[str, Any] = {"max_new_tokens": 32, "do_sample": False, "temperature": 1.0, "top_p": 1.0}
EXAMPLE_PROMPT = "It is a truth universally acknowledged that"


def requirements() -> list[str]:
    """What a serving environment needs (pinned to this install); torchvision is not among them."""
    import mlflow
    import safetensors
    import tokenizers
    import torch
    import transformers

    return [f"mlflow=={mlflow.__version__}", f"torch=={torch.__version__.split('+')[0]}",
            f"transformers=={transformers.__version__}", f"tokenizers=={tokenizers.__version__}",
            f"safetensors=={safetensors.__version__}", "accelerate"]


def needs_remote_code(model_dir: Path) -> bool:
    """Per-layer width outputs ship their modeling code beside the weights (`auto_map`)."""
    return "auto_map" in json.loads((Path(model_dir) / "config.json").read_text())


def build(model_dir: Path, out: Path, run_id: str, model_id: str | None, metadata: dict[str, str],
          loaded: tuple | None = None) -> dict[str, str]:
    """Write the flavor's files for the HF directory `model_dir` into `out` (weights excluded).

    MLflow's writer needs the model in memory and saves its weights too; that copy stays in a
    local temp dir and is deleted, the loader reads the checkpoint's own `model/` instead.
    Returns relative path -> sha256 of what was written. `loaded`: that directory's (model, tokenizer)
    when the caller already holds them.
    """
    import mlflow
    from mlflow.models import Model, infer_signature

    from pip_core import io as core_io

    config = core_io.read_config(model_dir)
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    net, tokenizer = loaded or core_io.load(model_dir, dtype=dtype)
    remote = needs_remote_code(model_dir)
    metadata = {**metadata, REQUIRES_REMOTE_CODE: str(remote).lower(),
                WEIGHTS: f"{MODEL_SUBDIR}/ beside this MLmodel (the pipprune checkpoint)"}
    if remote:
        metadata[REMOTE_CODE] = ("per-layer widths: config.json auto_map names modeling_pipprune.py in "
                                            "model/; MLflow's loader passes trust_remote_code=True for it")
    signature = infer_signature([EXAMPLE_PROMPT], ["generated text"], params=INFERENCE_PARAMS)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".mlflow-model-", dir=out.parent) as tmp:
        target = Path(tmp) / "m"
        mlflow.transformers.save_model(
            transformers_model={"model": net, "tokenizer": tokenizer}, path=str(target), task=TASK,
            signature=signature, input_example=([EXAMPLE_PROMPT], {"max_new_tokens": 8, "do_sample": False}),
            pip_requirements=requirements(), metadata=metadata)
        written = target / MODEL_SUBDIR
        if not (written / "config.json").is_file():
            raise RuntimeError(f"MLflow wrote no {MODEL_SUBDIR}/config.json: the flavor layout changed, refusing "
                               "to register a model whose loader would not find the checkpoint's weights")
        shutil.rmtree(written)
        for stray in ("LICENSE.txt", "README.md"):  # a license guessed from the hub; a card we keep in MLflow
            (target / stray).unlink(missing_ok=True)
        mlmodel = Model.load(str(target / "MLmodel"))
        mlmodel.run_id, mlmodel.model_id = run_id, model_id
        mlmodel.flavors["transformers"]["torch_dtype"] = f"torch.{dtype}"
        mlmodel.flavors["transformers"].pop("source_model_name", None)  # a local temp path, meaningless elsewhere
        mlmodel.save(str(target / "MLmodel"))
        for item in target.iterdir():
            shutil.move(str(item), out / item.name)
    files = sha256_dir(out)
    (out / FILES_MANIFEST).write_text(json.dumps(files, indent=1, sort_keys=True))
    return files


def files_manifest_sha256(out: Path) -> str:
    return sha256_bytes((out / FILES_MANIFEST).read_bytes())
