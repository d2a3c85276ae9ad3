"""Shared benchmark plumbing: inputs from the reference build, results as JSON + a markdown table."""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from infra.layout import model_dir_layout

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_MODEL = ROOT / ".pipprune" / "reference" / "small"


def environment() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine(), "when": datetime.now(timezone.utc).isoformat(timespec="seconds")}


#: what --calibration names in the benchmarks: the reference build's corpus, texts the model samples itself, or
#: half of each (the product's `--calibration self`, `--calibration self:0.5,DIR:0.5`)
CALIBRATIONS = ("corpus", "self", "mix")


def calibration_pairs(model_dir: Path, n: int, seed: int, rate: float | None = None, source: str = "corpus",
                      model=None, tokenizer=None) -> tuple[list[tuple[str, str]], list[str]]:
    """(original, perturbed) pairs as the pipeline makes them, from the reference build's calibration data
    (`corpus`), from texts sampled from `model` (`self`, seeded), or half of each (`mix`).

    `rate`: fraction of words the perturber edits (None: the Perturber's default, the product's 0.15).
    """
    from infra.calibration import draw_sources, load_calibration
    from infra.calibration_spec import CalibrationSpec
    from pip_core.perturb import Perturber
    from pip_core.self_calibration import SamplingOptions, model_word_list, sampled_texts
    from pip_core.wordlist import WordList

    if source == "corpus":
        texts = list(load_calibration(model_dir_layout(model_dir).calibration, n_samples=n, seed=seed)["text"])
        words = WordList.from_file(model_dir_layout(model_dir).wordlist)
    else:
        spec = CalibrationSpec.parse("self" if source == "self" else f"self:0.5,{model_dir}:0.5")
        rows, words = draw_sources(spec, n, seed, lambda count: sampled_texts(model, tokenizer, SamplingOptions(
                                       n=count, seed=seed, progress=False)),
                                   lambda texts: model_word_list(model, tokenizer, texts))
        texts = [r["text"] for r in rows]
    result = Perturber(words, seed=seed, **({} if rate is None else {"rate": rate})).perturb_many(texts)
    return [(p.original, p.perturbed) for p in result.pairs], texts


def write(name: str, payload: dict, table: list[str]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "environment": environment(), **payload}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=1, default=str))
    md = RESULTS / f"{name}.md"
    md.write_text("\n".join(table) + "\n")
    return md


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


def add_harness_args(parser: argparse.ArgumentParser) -> None:
    """The options of the KL harnesses (divergence, ablation): window, width mode, threads, held-out sets, resume."""
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--width-mode", default="uniform", choices=["uniform", "per_layer"],
                        help="width units: same cut in every layer (the product default) or each layer its own")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    parser.add_argument("--heldout", default="persuasion,wordnet",
                        help="comma list of persuasion, wordnet or JSONL/TXT files; the first names the main result, "
                             "each other one writes NAME_<set>")
    parser.add_argument("--resume", type=Path, default=None,
                        help="JSONL of finished runs: runs found there are reused, new ones appended")


def quality_grid_parser(model: Path, ratios: str) -> argparse.ArgumentParser:
    """The options of the lm-eval quality benchmarks (quality, width_mode): model, grid, items, pairs, steps."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=model)
    parser.add_argument("--ratios", default=ratios)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--limit", type=int, default=300)
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=2)
    return parser
