"""The evaluation kit every run is judged with: a general-text held-out set and the WordNet cloze task.

The quick eval's held-out texts come from the calibration source, so for a model calibrated on its own samples
they are the very distribution it was pruned and distilled on: a compressed model that loops on every prompt can
still pass there. The kit holds text no reference model was trained on: Jane Austen's *Persuasion* (public
domain, Debian's r-cran-janeaustenr, held out by the reference builds), cut into windows of whole words, and the
lm-eval tasks a reference build writes (`lmeval_tasks.write_tasks`: the WordNet cloze, from Debian's wordnet-base,
and Persuasion perplexity). Built once under HOME/cache/eval-kit/<recipe digest>, under a file lock, its
`kit.json` written last: a kit without it is a build that died and is made again, never read half-written.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock
from transformers import PreTrainedTokenizerBase

from infra import atomic
from infra.reference import lmeval_tasks, sources
from infra.reference.lmeval_tasks import CLOZE_TASK, PERSUASION_TASK

KIT_VERSION = 1
#: the general set holds at least this many predicted tokens, counted by the tokenizer of the model measured
MIN_TOKENS = 30_000
#: words per window (about 120 tokens of SmolLM2's tokenizer), and the tokens a window is cut to at most
WINDOW_WORDS = 96
MAX_LENGTH = 256
#: the cloze task's items, as a reference build writes them (write_tasks' defaults)
CLOZE_SEED = 0
#: the lm-eval tasks the kit defines (tasks.evaluation finds them here when no include path is given)
KIT_TASKS = (CLOZE_TASK, PERSUASION_TASK)
GENERAL_SOURCE = (f"Jane Austen, Persuasion (public domain, Debian {sources.AUSTEN_DEB}; held out from every "
                  f"reference model's training): windows of {WINDOW_WORDS} whole words")
#: the fraction of i * phi orders the windows so that every prefix is spread evenly over the novel
_GOLDEN = (5 ** 0.5 - 1) / 2
_WINDOWS_FILE, _MARKER = "windows.jsonl", "kit.json"


class EvalKitError(RuntimeError):
    """The kit cannot be built here; the message names the missing Debian package and the command that installs it."""


@dataclass(frozen=True)
class GeneralSet:
    """The general held-out set as one tokenizer reads it: the first windows of the kit's order that hold
    MIN_TOKENS predicted tokens, in a content-addressed JSONL file ({"text": ...} per line)."""

    path: Path
    sha256: str
    tokens: int  # predicted tokens (each window's tokens at max_length, less one)
    windows: int
    max_length: int
    source: str = GENERAL_SOURCE

    def texts(self) -> list[str]:
        return _read_jsonl(self.path)

    def encode(self, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
        """Each window's token ids, cut as the token count was."""
        return [_encode(tokenizer, text, self.max_length) for text in self.texts()]

    def record(self) -> dict:
        """What the summary and the version tags name: the text, its sha256, windows and tokens."""
        return {"source": self.source, "sha256": self.sha256, "tokens": self.tokens, "windows": self.windows,
                "max_length": self.max_length}


@dataclass(frozen=True)
class EvalKit:
    """The built kit: every window of the novel in the fixed order, and the lm-eval tasks folder."""

    folder: Path
    tasks_dir: Path
    cloze_task: str = CLOZE_TASK
    meta: dict = field(default_factory=dict, compare=False)

    def general_set(self, tokenizer: PreTrainedTokenizerBase, max_length: int = MAX_LENGTH,
                    min_tokens: int = MIN_TOKENS) -> GeneralSet:
        """The shortest prefix of the windows holding `min_tokens` predicted tokens for `tokenizer`, each window cut
        to `max_length` tokens (written once per content, beside the windows)."""
        texts, tokens = [], 0
        for text in _read_jsonl(self.folder / _WINDOWS_FILE):
            texts.append(text)
            tokens += max(len(_encode(tokenizer, text, max_length)) - 1, 0)
            if tokens >= min_tokens:
                break
        else:
            raise EvalKitError(f"the general held-out set holds {tokens} tokens for this tokenizer at {max_length} "
                               f"tokens a window, fewer than the {min_tokens} asked for")
        payload = _jsonl(texts)
        sha = hashlib.sha256(payload.encode()).hexdigest()
        path = self.folder / f"general-{sha[:16]}.jsonl"
        if not path.is_file():
            atomic.write_text(path, payload)
        return GeneralSet(path=path, sha256=sha, tokens=tokens, windows=len(texts), max_length=max_length)


def recipe() -> str:
    """Digest of what makes the kit (its parameters and the code that extracts and writes the data): a change
    builds a new kit beside the old one."""
    h = hashlib.sha256(json.dumps([KIT_VERSION, WINDOW_WORDS, CLOZE_SEED]).encode())
    for module in (lmeval_tasks, sources):
        h.update(Path(module.__file__).read_bytes())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()


def eval_kit(home: Path | None = None) -> EvalKit:
    """The kit under `home` (default: the state dir), built on first use (about 10 s) and read after that."""
    from infra.settings import Settings

    cache = (home or Settings().home) / "cache"
    folder = cache / "eval-kit" / recipe()[:16]
    kit = _open(folder)
    if kit is not None:
        return kit
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        kit = _open(folder)
        if kit is None:
            _build(folder, cache)
            kit = _open(folder)
    assert kit is not None, f"{folder} was built without its {_MARKER}"
    return kit


def kit_tasks_dir(tasks: tuple[str, ...] | list[str], home: Path | None = None) -> Path | None:
    """The kit's tasks folder when `tasks` are the kit's (built on demand); None when none is.

    lm-eval reads a task folder without its own registry (infra.lmeval), so kit and registry tasks in one list are
    refused here, before any model is evaluated.
    """
    ours = set(tasks) & set(KIT_TASKS)
    if not ours:
        return None
    if others := sorted(set(tasks) - ours):
        raise EvalKitError(f"lm-eval tasks {', '.join(others)} cannot run beside the evaluation kit's "
                           f"{', '.join(sorted(ours))} without an include path; name only one kind, or pass "
                           "--include-path with a folder holding all of their YAMLs")
    return eval_kit(home).tasks_dir


def ordered_windows(text: str, words: int = WINDOW_WORDS) -> list[str]:
    """`text` cut into consecutive windows of `words` whole words (a last shorter one dropped), ordered by the
    fractional part of i * phi: any prefix is spread evenly over the whole text, with no random generator."""
    tokens = text.split()
    cut = [" ".join(tokens[s:s + words]) for s in range(0, len(tokens) - words + 1, words)]
    return [cut[i] for i in sorted(range(len(cut)), key=lambda i: (i * _GOLDEN) % 1.0)]


def _open(folder: Path) -> EvalKit | None:
    marker = folder / _MARKER
    if not marker.is_file():
        return None
    return EvalKit(folder=folder, tasks_dir=folder / "tasks", meta=json.loads(marker.read_text()))


def _build(folder: Path, cache: Path) -> None:
    """Extract Persuasion, write its windows and the lm-eval tasks, then the marker (under the caller's lock)."""
    if not (sources.WORDNET / "data.noun").is_file():
        raise EvalKitError(f"the evaluation kit's WordNet cloze task needs Debian's wordnet-base ({sources.WORDNET} "
                           "is missing); install it: sudo apt-get install -y --no-install-recommends wordnet-base "
                           "(or, as root: bash scripts/install_data_packages.sh)")
    text = _persuasion(cache)
    shutil.rmtree(folder, ignore_errors=True)  # what a build that died half way left
    folder.mkdir(parents=True)
    windows = ordered_windows(text)
    atomic.write_text(folder / _WINDOWS_FILE, _jsonl(windows))
    tasks = lmeval_tasks.write_tasks(folder / "tasks", text, seed=CLOZE_SEED)  # the same tasks as a reference build
    meta = {"recipe": recipe(), "persuasion_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "windows": len(windows), "tasks": sorted(tasks)}
    atomic.write_text(folder / _MARKER, json.dumps(meta, indent=1))


def _persuasion(cache: Path) -> str:
    """The held-out novel from the janeaustenr .deb (downloaded into `cache` once, not installed: that pulls R)."""
    how = (f"run: mkdir -p {cache / 'debs'} && cd {cache / 'debs'} && apt-get download {sources.AUSTEN_DEB} "
           "(no root needed, nothing is installed: pipprune unpacks it; sudo apt-get update first if apt cannot "
           "find it)")
    try:
        return sources.austen_books(cache)[sources.AUSTEN_HELDOUT]
    except sources.MissingDataPackage as exc:
        raise EvalKitError(f"the evaluation kit's general held-out set needs Debian's {sources.AUSTEN_DEB}: "
                           f"{exc}; {how}") from None
    except (subprocess.CalledProcessError, FileNotFoundError, StopIteration) as exc:
        raise EvalKitError(f"the evaluation kit's general held-out set needs Debian's {sources.AUSTEN_DEB}, which "
                           f"could not be fetched or unpacked ({exc}); {how}") from None


def _encode(tokenizer: PreTrainedTokenizerBase, text: str, max_length: int) -> list[int]:
    return list(tokenizer(text, truncation=True, max_length=max_length)["input_ids"])


def _jsonl(texts: list[str]) -> str:
    return "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts)


def _read_jsonl(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
