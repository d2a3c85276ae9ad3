"""The one place that names the file layout pipprune writes and reads in a model directory.

A reference build (`pipprune reference build`) is an ordinary Hugging Face directory with its own
calibration corpus and lm-eval tasks beside the weights; a resolved calibration (texts drawn from
`self` or a mix) is written in the same shape. Everything that looks for those files asks here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: calibration texts (JSONL, one {"text": ...} per line) and the perturber's word list beside them
CALIBRATION_FILE = "calibration.jsonl"
WORDLIST_FILE = "wordlist.txt"
#: lm-eval task YAMLs of a reference build, and the held-out text (Persuasion) among their data
TASKS_DIR = "tasks"
HELDOUT_FILE = "persuasion.jsonl"


@dataclass(frozen=True)
class ModelDirLayout:
    """Where a reference build keeps its calibration corpus, word list and local lm-eval tasks."""

    root: Path

    @property
    def calibration(self) -> Path:
        return self.root / "calibration" / CALIBRATION_FILE

    @property
    def wordlist(self) -> Path:
        return self.calibration.with_name(WORDLIST_FILE)

    @property
    def tasks(self) -> Path:
        return self.root / TASKS_DIR

    @property
    def heldout(self) -> Path:
        return self.tasks / HELDOUT_FILE

    def has_calibration(self) -> bool:
        """True for a reference build (or any directory laid out like one): it brings its own calibration text."""
        return self.calibration.is_file()

    def task_names(self) -> list[str]:
        """The local lm-eval tasks it carries (YAML stems), sorted; empty when it has none."""
        return sorted(p.stem for p in self.tasks.glob("*.yaml")) if self.tasks.is_dir() else []


def model_dir_layout(path: str | Path) -> ModelDirLayout:
    return ModelDirLayout(Path(path).expanduser())
