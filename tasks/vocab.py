"""trim_vocabulary: the source with its vocabulary trimmed to a corpus, as the run's dense model.

The trimmed copy is written once into the cache under a name made of the source's content and the corpus's
(infra.vocab_source.trimmed_copy: written to a private sibling, every corpus text re-encoded and compared, then
renamed into place), so a rerun or a resumed run reads the same directory. Every later stage (calibration, the
dense figures, scoring, KD's teacher) reads the trimmed model: the vocabularies of teacher and student match. The
model as given stays in the ref for lineage and for the ratio the target is of.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import task

from infra.config import VocabSettings
from infra.settings import Settings
from infra.vocab_source import trimmed_copy
from pip_core import io as core_io
from tasks.refs import ModelRef, SourceRef

log = logging.getLogger(__name__)


@task(name="trim-vocabulary")
def trim_vocabulary(source: SourceRef, settings: VocabSettings) -> SourceRef:
    """`source` with `model` its vocabulary-trimmed copy, `original` the model as given and `vocab` the record."""
    out, record = trimmed_copy(Path(source.model.local_dir), source.model.fingerprint, settings.corpus,
                               Settings().home / "cache")
    trimmed = ModelRef(local_dir=str(out), fingerprint=core_io.model_fingerprint(out),
                       num_params=int(record["params_after"]))
    log.info("vocabulary %d -> %d tokens (%s): %d -> %d parameters, kept ids sha256 %s", record["vocab_before"],
             record["vocab_after"], record["corpus"], source.model.num_params, trimmed.num_params,
             record["kept_sha256"][:16])
    return source.model_copy(update={"model": trimmed, "original": source.model,
                                     "vocab": {**record, "source": source.model_id, "dense_fingerprint":
                                               trimmed.fingerprint}})
