"""Collect every benchmarks/results/*.md table into benchmarks/results/README.md (linked from the README)."""

from __future__ import annotations

from benchmarks.common import RESULTS

ORDER = ["quality", "cost", "overhead", "inference", "recovery"]

HEADER = """# pipprune benchmarks

All figures were measured on the project's 2-core CPU machine (no GPU); the JSON beside each table
holds every run, the environment and the arguments. Regenerate: `make bench` (or each
`python -m benchmarks.<name>`), then `python -m benchmarks.report`. Ratios are measured within one
run because the machine is shared and noisy. `benchmarks/gpu_check.sh` is the GPU check (not run
here: no accelerator was lent to this task).
"""


def main() -> None:
    parts = [HEADER]
    for name in ORDER:
        path = RESULTS / f"{name}.md"
        if path.is_file():
            parts.append(path.read_text())
    (RESULTS / "README.md").write_text("\n".join(parts))
    print(RESULTS / "README.md")


if __name__ == "__main__":
    main()
