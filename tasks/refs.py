"""Small, JSON-serialisable descriptors that tasks pass instead of live objects.

Prefect persists these as task results (JSON, never pickle) and cache keys are built from them,
so they must name content (hashes), not just locations.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Ref(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelRef(_Ref):
    """A model directory: where it is locally, what it contains, and its S3 copy once uploaded."""

    local_dir: str
    fingerprint: str
    num_params: int
    s3_uri: str | None = None
    manifest_sha256: str | None = None


class SourceRef(_Ref):
    """The run's dense model (`model`: what every stage reads) and where it came from."""

    model_id: str
    model: ModelRef
    #: when the source is a GGUF file: its record (file, sha256, quant_types, ...; infra.gguf_source)
    gguf: dict | None = None
    #: when the vocabulary was trimmed first: the model as the user gave it (`model` is then its trimmed copy), and
    #: the trim's record (corpus, its sha256, tokens and parameters before and after, the kept ids' sha256)
    original: ModelRef | None = None
    vocab: dict | None = None

    @property
    def given(self) -> ModelRef:
        """The model as the user gave it (what lineage names and the target's ratio is of)."""
        return self.original or self.model

    @property
    def params_before(self) -> int:
        """The parameters a ratio is of: the model as given, before its vocabulary was trimmed."""
        return self.given.num_params


class CalibrationRef(_Ref):
    """The prepared calibration: the scoring, held-out and recovery texts on disk, and what every task needs of
    the source.

    `pairs_path` holds the scoring texts, one row each with its perturbed view (`perturbed` null when the
    method perturbs nothing: then `n_pairs` and `n_skipped` are 0 and `wordlist_hash` is empty). `source_path` is
    the resolved calibration file, `source_digest` the content of that file and its word list
    (`infra.calibration.CalibrationSource.digest`), `max_length` the tokens per text every task truncates to; so
    no task rebuilds the source from the raw config string. `recovery_path` holds the recovery's texts, drawn
    apart from the scoring and held-out ones (None: none were asked for).
    """

    pairs_path: str
    heldout_path: str
    data_hash: str
    wordlist_hash: str
    n_pairs: int
    n_skipped: int
    n_heldout: int
    source_path: str
    source_digest: str
    max_length: int
    #: scoring texts (every one, perturbed or not: the pairs' originals when the method perturbs)
    n_texts: int = 0
    recovery_path: str | None = None
    n_recovery: int = 0


class StatsRef(_Ref):
    """Per-unit importance statistics computed on one model."""

    path: str
    model_fingerprint: str
    method: str
    unit: str
    n_units: int
    seconds: float


class PrunePlan(_Ref):
    """Which units one step removes, with the validated score table behind the choice."""

    table_path: str
    table_sha256: str
    units: tuple[dict, ...]
    params_to_remove: int
    params_selected: int


class BudgetRef(_Ref):
    """The planned budget of a run (pip_core.budget.BudgetPlan): the ratio the steps follow, the alignment, the tags."""

    ratio: float
    effective_align: int
    params_after: int
    tags: dict[str, str]
    plan: dict


class CheckpointInfo(_Ref):
    iteration: int
    s3_uri: str
    manifest_sha256: str


class SignatureRef(_Ref):
    """An OpenSSF model-signing signature of a checkpoint's model directory, stored in S3 beside it."""

    uri: str
    sha256: str
    key_fingerprint: str

    def tags(self) -> dict[str, str]:
        """The registered version's tags that `lineage` and `promote` check the signature against."""
        from infra.tags import SIGNATURE_SHA256, SIGNATURE_URI, SIGNING_KEY_FINGERPRINT

        return {SIGNATURE_URI: self.uri, SIGNATURE_SHA256: self.sha256, SIGNING_KEY_FINGERPRINT: self.key_fingerprint}
