"""`--calibration` parsed once: which sources the calibration texts come from, and in which shares.

A source is a calibration file, a reference build's directory, or `self` (texts the model samples
itself, pip_core.self_calibration); several mix by weight (`self:0.5,calib.jsonl:0.5`). The job config
validates the spelling into this value object, and the run's defaults, the calibration tasks, the
preflight checks and the lineage all read it instead of the raw string.
"""

from __future__ import annotations

from dataclasses import dataclass

from pip_core.errors import CalibrationError

#: the calibration source that is the model itself (pip_core.self_calibration)
SELF = "self"


@dataclass(frozen=True)
class CalibrationSpec:
    """(source, weight) parts, weights summing to 1, in the order given."""

    parts: tuple[tuple[str, float], ...]

    @classmethod
    def parse(cls, spec: str) -> CalibrationSpec:
        """One source, or several `SOURCE:WEIGHT` separated by commas (a ':' inside a path is kept)."""
        parts = []
        for item in (p.strip() for p in str(spec).split(",")):
            source, sep, weight = item.rpartition(":")
            try:
                value = float(weight) if sep else 1.0
            except ValueError:  # a ':' that is part of the path
                source, value = item, 1.0
            source = source if sep and source else item
            if not source or not value > 0 or value == float("inf"):
                raise CalibrationError(f"calibration source {item!r} in {spec!r}: write SOURCE or SOURCE:WEIGHT with "
                                       "a weight > 0, sources separated by commas")
            parts.append((source, value))
        total = sum(w for _, w in parts)
        return cls(tuple((source, weight / total) for source, weight in parts))

    @property
    def is_self(self) -> bool:
        """Every text is the model's own: the case the own-text defaults (infra.config) apply to."""
        return all(source == SELF for source, _ in self.parts)

    @property
    def single_file(self) -> str | None:
        """The one file or reference directory this spec names, read as it is; None for `self` and mixes."""
        if len(self.parts) == 1 and self.parts[0][0] != SELF:
            return self.parts[0][0]
        return None

    @property
    def files(self) -> list[str]:
        """The file and directory sources, in order (not `self`)."""
        return [source for source, _ in self.parts if source != SELF]

    @property
    def kind(self) -> str:
        """'self', 'file' or 'mix': what the summary and the lineage say of the texts' origin."""
        return SELF if self.is_self else ("file" if self.single_file else "mix")

    def __str__(self) -> str:
        if len(self.parts) == 1:
            return self.parts[0][0]
        return ",".join(f"{source}:{weight:g}" for source, weight in self.parts)
