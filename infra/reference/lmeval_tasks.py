"""Local lm-eval tasks from offline data: Persuasion perplexity and a WordNet cloze.

YAMLs are generated with absolute data paths because lm-eval resolves relative `data_files`
against the working directory, not the YAML.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import yaml

from infra.reference import sources

PERSUASION_TASK = "pipprune_persuasion"
CLOZE_TASK = "pipprune_wordnet_cloze"


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def persuasion_chunks(text: str, words: int = 120, n: int = 60) -> list[str]:
    """Evenly spaced chunks of the held-out novel."""
    tokens = text.split()
    starts = list(range(0, max(1, len(tokens) - words), max(words, (len(tokens) - words) // n)))[:n]
    return [" ".join(tokens[s: s + words]) for s in starts]


def wordnet_cloze(n: int = 1000, seed: int = 0) -> list[dict]:
    """Prefix of an example sentence up to a lemma of its synset -> pick that lemma among 4."""
    entries = sources.wordnet_entries()
    pool: dict[str, list[str]] = {}
    for pos, lemmas, _ in entries:
        pool.setdefault(pos, []).extend(lem for lem in lemmas if lem.isalpha() and lem.islower() and len(lem) > 2)
    pools = {pos: sorted(set(words)) for pos, words in pool.items()}
    rng = random.Random(seed)
    items = []
    for pos, lemmas, examples in entries:
        for example in examples:
            for lemma in lemmas:
                if not (lemma.isalpha() and lemma.islower()):
                    continue
                m = re.search(rf"(?<=\s){re.escape(lemma)}\b", example)
                if m is None or len(example[: m.start()].split()) < 3:
                    continue
                prefix = example[: m.start()].rstrip()
                distractors: list[str] = []
                while len(distractors) < 3:
                    cand = rng.choice(pools[pos])
                    if cand != lemma and cand not in distractors:
                        distractors.append(cand)
                choices = [lemma, *distractors]
                rng.shuffle(choices)
                items.append({"prefix": prefix, "choices": [" " + c for c in choices], "label": choices.index(lemma),
                              "pos": pos})
                break
    rng.shuffle(items)
    return items[:n]


def write_tasks(out_dir: Path, heldout_text: str, seed: int = 0, cloze_items: int = 1000) -> dict[str, Path]:
    """Write both tasks' data and YAML into `out_dir` (use it as lm-eval's include_path)."""
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    ppl_data, cloze_data = out_dir / "persuasion.jsonl", out_dir / "wordnet_cloze.jsonl"
    _jsonl(ppl_data, [{"text": t} for t in persuasion_chunks(heldout_text)])
    _jsonl(cloze_data, wordnet_cloze(cloze_items, seed))
    common = {"dataset_path": "json", "test_split": "test"}
    ppl = {"task": PERSUASION_TASK, **common, "dataset_kwargs": {"data_files": {"test": str(ppl_data)}},
           "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
           "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"}, {"metric": "bits_per_byte"}],
           "metadata": {"version": 1.0}}
    cloze = {"task": CLOZE_TASK, **common, "dataset_kwargs": {"data_files": {"test": str(cloze_data)}},
             "output_type": "multiple_choice", "doc_to_text": "{{prefix}}", "doc_to_choice": "{{choices}}",
             "doc_to_target": "label", "target_delimiter": "",
             "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                             {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
             "metadata": {"version": 1.0}}
    paths = {}
    for spec in (ppl, cloze):
        path = out_dir / f"{spec['task']}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        paths[spec["task"]] = path
    return paths
