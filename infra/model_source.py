"""Where a model comes from: a local directory, or a hub id materialised into the HF cache.

Free of Prefect imports so command-line checks can run before the orchestration stack is set up.
"""

from __future__ import annotations

from pathlib import Path


class ModelNotFoundError(ValueError):
    """The model id is neither a local directory nor resolvable on the hub/cache."""


def local_model_dir(model_id: str) -> Path:
    path = Path(model_id).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model not found: {path} is not a Hugging Face model directory (no config.json)")
        return path.resolve()
    if model_id.startswith((".", "/", "~")) or model_id.count("/") > 1:
        raise ModelNotFoundError(f"model not found: {model_id} does not exist; pass a local model directory "
                                 "(with config.json) or a Hugging Face hub id (org/name) to --model")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id=model_id, allow_patterns=[
            "*.json", "*.safetensors", "*.model", "*.txt", "*.py", "tokenizer*"]))
    except (HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError, OSError) as exc:
        raise ModelNotFoundError(
            f"model not found: {model_id!r} is neither a local directory nor available from the Hugging Face "
            f"hub/cache ({type(exc).__name__}: {exc})"
        ) from exc
