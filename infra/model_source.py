"""Where a model comes from: a local directory, a GGUF file dequantized into pipprune's cache (see
infra.gguf_source), or a hub id materialised into the HF cache.

Free of Prefect imports so command-line checks can run before the orchestration stack is set up.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


class ModelNotFoundError(ValueError):
    """The model id is neither a local directory nor resolvable on the hub/cache."""


def local_model_dir(model_id: str) -> Path:
    """An ordinary Hugging Face directory holding `model_id` (a directory, a GGUF file, or a hub id)."""
    from infra.gguf_source import is_gguf

    if is_gguf(model_id):
        return gguf_model_dir(model_id)
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


def gguf_model_dir(model_id: str) -> Path:
    """The dequantized directory of a GGUF file, made on first use (in PIPPRUNE_HOME/cache/gguf)."""
    from infra.gguf_source import GgufError, cache_dir_for, dequantize_to_dir
    from infra.settings import Settings

    path = Path(model_id).expanduser().resolve()
    if not path.is_file():
        raise ModelNotFoundError(f"model not found: GGUF file {path} does not exist")
    try:
        source = gguf_source(str(path), path.stat().st_size, path.stat().st_mtime_ns)
        return dequantize_to_dir(source, cache_dir_for(source, Settings().home / "cache"))
    except GgufError as exc:
        raise ModelNotFoundError(str(exc)) from exc


@lru_cache(maxsize=8)
def gguf_source(path: str, size: int, mtime_ns: int):  # noqa: ANN201 - infra.gguf_source.GgufSource
    """The header and sha256 of a GGUF file, read once per process while the file is unchanged."""
    from infra.gguf_source import inspect_gguf

    del size, mtime_ns  # part of the cache key only
    return inspect_gguf(path)
