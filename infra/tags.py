"""The MLflow tag names pipprune writes and reads: the tracking vocabulary, named once.

Runs and registered versions carry these tags; `pipprune lineage`, `promote` and `export` read
them back, so a name is spelled here and only here. The string values are a contract with every
version already registered: never rename one. pip_core knows none of them.
"""

from __future__ import annotations

PREFIX = "pipprune."

# lineage: what a run and its registered version were made from (`lineage` cross-checks these)
RUN_KEY = "pipprune.run_key"
SOURCE_MODEL = "pipprune.source_model"
SOURCE_FINGERPRINT = "pipprune.source_fingerprint"
CALIBRATION_HASH = "pipprune.calibration_hash"
WORDLIST_HASH = "pipprune.wordlist_hash"
CONFIG_DIGEST = "pipprune.config_digest"
CODE_DIGEST = "pipprune.code_digest"
GIT_SHA = "pipprune.git_sha"
PREFECT_FLOW_RUN_ID = "pipprune.prefect_flow_run_id"
# a GGUF source: the file its dequantized weights came from
SOURCE_GGUF_FILE = "pipprune.source_gguf_file"
SOURCE_GGUF_PATH = "pipprune.source_gguf_path"
SOURCE_GGUF_SHA256 = "pipprune.source_gguf_sha256"
SOURCE_GGUF_QUANT_TYPES = "pipprune.source_gguf_quant_types"
# a vocabulary trimmed before pruning: the corpus, its sha256, the kept token ids' sha256, the tokens before->after,
# and the trimmed dense model's fingerprint (the model the run pruned, and its KD teacher)
VOCAB_CORPUS = "pipprune.vocab.corpus"
VOCAB_CORPUS_SHA256 = "pipprune.vocab.corpus_sha256"
VOCAB_KEPT_SHA256 = "pipprune.vocab.kept_sha256"
VOCAB_TOKENS = "pipprune.vocab.tokens"
VOCAB_DENSE_FINGERPRINT = "pipprune.vocab.dense_fingerprint"
#: the tags a version inherits from its run and `lineage` checks against the run's own
LINEAGE = (RUN_KEY, SOURCE_MODEL, SOURCE_FINGERPRINT, CALIBRATION_HASH, WORDLIST_HASH, CONFIG_DIGEST, CODE_DIGEST,
           GIT_SHA, PREFECT_FLOW_RUN_ID, SOURCE_GGUF_FILE, SOURCE_GGUF_PATH, SOURCE_GGUF_SHA256, SOURCE_GGUF_QUANT_TYPES,
           VOCAB_CORPUS, VOCAB_CORPUS_SHA256, VOCAB_KEPT_SHA256, VOCAB_TOKENS, VOCAB_DENSE_FINGERPRINT)

# the registered version: where its weights are and what produced them
MODEL_FINGERPRINT = "pipprune.model_fingerprint"
S3_URI = "pipprune.s3_uri"
MANIFEST_SHA256 = "pipprune.manifest_sha256"
MLFLOW_RUN_ID = "pipprune.mlflow_run_id"
ITERATIONS = "pipprune.iterations"
METHOD = "pipprune.method"
UNIT = "pipprune.unit"
RATIO = "pipprune.ratio"
FINAL_CHECKPOINT = "pipprune.final_checkpoint"
RECOVERY_STEPS = "pipprune.recovery_steps"
RECOVERY_KIND = "pipprune.recovery_kind"
#: the closed-form repair after each pruning step (none, bias, lstsq)
REPAIR = "pipprune.repair"
RECOVERY_KD_PARAMS = "pipprune.recovery_kd_params"
RECOVERY_TEMPERATURE = "pipprune.recovery_temperature"
#: sha256 over the MLflow model's files, and the logged model's id
MLFLOW_FILES_SHA256 = "pipprune.mlflow_files_sha256"
LOGGED_MODEL_ID = "pipprune.logged_model_id"

# the budget: what was asked, planned and reached
TARGET = "pipprune.target"
ALIGN = "pipprune.align"
ALIGN_EFFECTIVE = "pipprune.align_effective"
PLANNED_PARAMS = "pipprune.planned_params"
PLANNED_RATIO = "pipprune.planned_ratio"
PLANNED_MEMORY_BYTES = "pipprune.planned_memory_bytes"
ACHIEVED_RATIO = "pipprune.achieved_ratio"
ACHIEVED_PARAMS = "pipprune.achieved_params"

# the quality gate (promotion refuses a `not usable` verdict)
QUALITY_VERDICT = "pipprune.quality.verdict"
QUALITY_REASONS = "pipprune.quality.reasons"
QUALITY_MAX_KL = "pipprune.quality.max_kl"
QUALITY_MAX_PPL_RATIO = "pipprune.quality.max_ppl_ratio"
QUALITY_MIN_DISTINCT_RATIO = "pipprune.quality.min_distinct_ratio"
#: each figure the verdict read (format with metric=, e.g. general_ppl_ratio), and the general held-out set it read
QUALITY_FIGURE = "pipprune.quality.figure.{metric}"
QUALITY_GENERAL_SET_SHA256 = "pipprune.quality.general_set_sha256"
QUALITY_GENERAL_SET_TOKENS = "pipprune.quality.general_set_tokens"

# the OpenSSF model signature of the final checkpoint
SIGNATURE_URI = "pipprune.signature_uri"
SIGNATURE_SHA256 = "pipprune.signature_sha256"
SIGNING_KEY_FINGERPRINT = "pipprune.signing_key_fingerprint"

# MLflow datasets (format with context="calibration" or "evaluation"), serving, evaluation, promotion
DATASET_PREFIX = "pipprune.dataset."
DATASET_DIGEST = DATASET_PREFIX + "{context}.digest"
DATASET_SOURCE = DATASET_PREFIX + "{context}.source"
SERVING_BACKEND = "pipprune.serving.backend"
SERVING = "pipprune.serving.{key}"
EVAL_PREFIX = "pipprune.eval."
PROMOTION = "pipprune.promotion.{alias}.{key}"

# GGUF child versions (infra.gguf_store)
FORMAT = "pipprune.format"
GGUF_QUANT = "pipprune.gguf.quant"
GGUF_SHA256 = "pipprune.gguf.sha256"
GGUF_FILE = "pipprune.gguf.file"
GGUF_FILE_TYPE = "pipprune.gguf.file_type"
GGUF_MANIFEST_URI = "pipprune.gguf.manifest_uri"
GGUF_MANIFEST_SHA256 = "pipprune.gguf.manifest_sha256"
PARENT_NAME = "pipprune.parent_name"
PARENT_VERSION = "pipprune.parent_version"
PARENT_MODEL_FINGERPRINT = "pipprune.parent_model_fingerprint"
PARENT_MANIFEST_SHA256 = "pipprune.parent_manifest_sha256"
HELDOUT_SHA256 = "pipprune.heldout_sha256"

# metadata of the MLflow model (MLmodel), not tags, in the same namespace
REQUIRES_REMOTE_CODE = "pipprune.requires_remote_code"
WEIGHTS = "pipprune.weights"
REMOTE_CODE = "pipprune.remote_code"

# sweeps (tasks.sweep): the parent run and each point's run
SWEEP = "pipprune.sweep"
SWEEP_ROLE = "pipprune.sweep.role"
SWEEP_POINT = "pipprune.sweep.point"
SWEEP_POINT_KEY = "pipprune.sweep.point_key"
SWEEP_RAN_IN = "pipprune.sweep.ran_in"
SWEEP_WALL_S = "pipprune.sweep.wall_s"
SWEEP_PARETO = "pipprune.sweep.pareto"
