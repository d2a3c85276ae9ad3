"""Validated configuration of one compress job.

One object describes the whole job so that its content hash can key caches, name S3 prefixes and
be recorded in lineage. Unknown keys are rejected: a typo in a config file must not silently
fall back to a default.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from pip_core.recovery import RecoveryOptions
    from pip_core.repair import RepairOptions
from infra.calibration_spec import SELF, CalibrationSpec
from infra.layout import model_dir_layout
from pip_core.vocabulary import (
    BLOCK_ONLY_METHODS,
    MAX_RATIO,
    METHOD_ALIASES,
    WIDTH_ONLY_METHODS,
    KdParams,
    Method,
    PruneTarget,
    RecoveryKind,
    WidthMode,
    WidthSplit,
)


class _Group(BaseModel):
    """A group of settings passed whole to the code that uses it (no loose scalars)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class CalibrationSettings(_Group):
    """Which texts are scored, how many, how long, and how they are perturbed."""

    source: str = Field("self", description="calibration JSONL/TXT file, a reference model dir, or self (texts "
                        "sampled from the model); several mixed by weight: self:0.5,calib.jsonl:0.5")
    wordlist: str | None = Field(None, description="word list deciding real words for the perturber "
                                                   "(default: beside the calibration file)")
    n_samples: int = Field(128, ge=1, le=100_000, description="calibration pairs scored per step (128: the ablations)")
    heldout_samples: int = Field(16, ge=0, le=100_000, description="texts held out for the quick perplexity eval")
    recovery_samples: int = Field(128, ge=0, le=10_000_000, description="texts drawn for recovery training, apart "
                                  "from the scored and the held-out ones (used only when recovery is on)")
    max_length: int = Field(128, ge=2, le=32_768, description="tokens per text window (scoring and quick eval)")
    perturb_rate: float = Field(0.15, gt=0.0, le=1.0, description="fraction of words the perturber edits")

    @field_validator("source")
    @classmethod
    def _parse_source(cls, value: str) -> str:
        from pip_core.errors import PipCoreError

        try:
            return str(CalibrationSpec.parse(value))
        except PipCoreError as exc:
            raise ValueError(str(exc)) from None

    @property
    def spec(self) -> CalibrationSpec:
        """The source as a value object (which sources, in which shares): what every reader of it takes."""
        return CalibrationSpec.parse(self.source)


def implied_unit(unit: str | None, method: object) -> str | None:
    """The unit a scoring group asks for: `unit` as given, else "block" for a method that scores only whole blocks
    (named in any of its spellings), else None (the default, width)."""
    if unit is not None:
        return unit
    return "block" if isinstance(method, str) and METHOD_ALIASES.get(method, method) in BLOCK_ONLY_METHODS else None


class ScoringSettings(_Group):
    """What is pruned, by which criterion, in how many re-scored steps."""

    # width: on the real model (SmolLM2-135M-Instruct, 3 seeds, docs/quality.md) uniform width keeps far more of
    # the model than any block criterion at 10% and 20% removed (PIP KL 0.83 vs the best block set's 1.04 at 0.2)
    unit: PruneTarget = Field("width", description="structural unit: width (attention head groups and MLP "
                                                   "channels) | attn | mlp | block (whole decoder layers)")
    method: Method = Field("pip", description="criterion: pip | pip_l2 | pip_first_order | pip_removal | "
                                          "pip_single_view | pip_removal_single_view | random | magnitude | "
                                          "taylor | block-influence | minitron | wanda_sp")
    iterations: int = Field(4, ge=1, le=100, description="prune/re-score steps to reach the ratio")
    width_mode: WidthMode = Field("uniform", description="uniform | per-layer: uniform cuts every layer alike, so "
                                  "the output is the family's stock config (vLLM, llama.cpp load it) and "
                                  "protect_first/last do not apply; per-layer keeps a custom config + modeling file")
    width_split: WidthSplit = Field("params", description="uniform widths: how a step's parameters are shared "
                                     "between attention groups and MLP channels: params (in proportion to their "
                                     "parameters) | scores (the split whose removed units have the lowest standardised "
                                     "scores); --unit mlp or attn prunes one kind alone")
    align: int = Field(64, ge=1, le=4096, description="uniform widths: every layer keeps a multiple of this many "
                       "MLP channels (GPU tile sizes; 1: any width; halved for models too narrow for it)")
    protect_first: int = Field(1, ge=0, description="leading decoder layers never pruned")
    protect_last: int = Field(1, ge=0, description="trailing decoder layers never pruned")

    @field_validator("method", mode="before")
    @classmethod
    def _alias_method(cls, value: object) -> object:
        return METHOD_ALIASES.get(value, value) if isinstance(value, str) else value

    @field_validator("width_mode", mode="before")
    @classmethod
    def _alias_width_mode(cls, value: object) -> object:
        return value.replace("-", "_") if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _unit_follows_a_block_method(cls, data: object) -> object:
        """A method that scores only whole blocks, named without a unit, prunes blocks (width is the default)."""
        if isinstance(data, dict) and data.get("unit") is None and implied_unit(None, data.get("method")):
            return {**data, "unit": "block"}
        return data

    @model_validator(mode="after")
    def _check_method_unit(self) -> ScoringSettings:
        if self.method in BLOCK_ONLY_METHODS and self.unit != "block":
            raise ValueError(f"method {self.method!r} scores whole blocks: use --unit block")
        if self.method in WIDTH_ONLY_METHODS and self.unit == "block":
            raise ValueError(f"method {self.method!r} scores attention groups and MLP channels: use --unit width, "
                             "attn or mlp")
        return self


class EvaluationSettings(_Group):
    """How the source and the pruned model are measured (general held-out set, lm-eval, continuations) and the
    quality gate on those figures."""

    tasks: tuple[str, ...] = Field((), description="lm-eval task names, comma separated")
    include_path: str | None = Field(None, description="directory of local lm-eval task YAMLs")
    limit: int | None = Field(None, ge=1, description="examples per lm-eval task (default: all)")
    tasks_origin: str | None = Field(None, description="why these tasks run (set by the CLI when it picks them)")
    prompts: tuple[str, ...] = Field(
        ("The capital of France is", "To make a cup of tea, first", "The old man looked out of the window and",
         "Once upon a time, in a small village,", "The most important thing to remember about science is",
         "My favourite season of the year is", "The recipe for bread is simple:", "The history of the Roman Empire"),
        description="prompts whose greedy continuations by the dense and the compressed model the summary shows "
                    "and the repetition bound reads (more prompts: less chance in which ones loop)")
    new_tokens: int = Field(64, ge=0, le=4096, description="tokens generated per prompt (0: no continuations, and no "
                            "repetition bound); 24 is too few for a loop to show")
    max_kl: float | None = Field(1.0, ge=0, description="quality gate: KL to the dense model (nats per token) on the "
                                 "calibration source's held-out texts above which the output is marked not usable "
                                 "and promotion is refused")
    max_ppl_ratio: float | None = Field(2.0, ge=1, description="quality gate: perplexity ratio to the dense model on "
                                        "the general held-out set (infra.eval_kit) above which the output is marked "
                                        "not usable")
    min_distinct_ratio: float | None = Field(0.75, ge=0, le=1, description="quality gate: share of distinct tokens "
                                             "in the compressed model's greedy continuations over the dense model's, "
                                             "below which the output is marked not usable (it loops; on SmolLM2-135M "
                                             "an enumeration loop on every prompt is at 0.68, another wording of the "
                                             "prompts at 0.82, pip_core.repetition)")

    @field_validator("tasks", mode="before")
    @classmethod
    def _split_tasks(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(t.strip() for t in value.split(",") if t.strip())
        return value


#: recovery steps when recovery is asked for (a kind named, or the own-text defaults) without a count: at batch 8,
#: two passes over the own-text defaults' 64 recovery texts, ~80 s of bf16 KD on 2 cores for SmolLM2-135M
#: (benchmarks/results/first_run.md: the whole first run within 10 minutes)
DEFAULT_RECOVERY_STEPS = 16


class RecoverySettings(_Group):
    """Optional recovery fine-tuning after the last pruning step; `steps == 0` (default) is off."""

    steps: int = Field(0, ge=0, le=1_000_000, description="recovery steps after pruning (0 = off)")
    kind: RecoveryKind = Field("lora", description="lora: LoRA on the LM loss | kd: distillation from the dense model "
                                                 "(KL on logits)")
    kd_params: KdParams = Field("lora", description="weights that kd trains: lora (adapters, merged back) | full | "
                                "consumers (o_proj, down_proj and the norms, at full rank)")
    warmup: float = Field(0.0, ge=0.0, lt=1.0, description="share of the steps the learning rate warms up over")
    decay: Literal["cosine", "constant"] = Field("constant", description="learning rate after the warm-up: constant, "
                                                 "or cosine decay to 0 at the last step")
    temperature: float = Field(1.0, gt=0.0, le=100.0, description="kd: softmax temperature of both models' logits "
                                                               "(loss scaled by T^2)")
    rank: int = Field(8, ge=1, le=1024, description="LoRA rank (kind lora, or kd with kd_params lora)")
    lr: float = Field(2e-3, gt=0.0, le=1.0, description="AdamW learning rate (full-weight kd wants about 10x less)")
    batch_size: int = Field(8, ge=1, le=4096)
    max_texts: int = Field(2048, ge=1, le=10_000_000,
                           description="calibration texts to train on (held-out texts never included)")

    @model_validator(mode="before")
    @classmethod
    def _kind_implies_steps(cls, data: object) -> object:
        """Naming a recovery kind without a step count asks for recovery: it gets the default count."""
        if isinstance(data, dict) and data.get("kind") is not None and data.get("steps") is None:
            return {**data, "steps": DEFAULT_RECOVERY_STEPS}
        return data

    @property
    def enabled(self) -> bool:
        return self.steps > 0

    def options(self, max_length: int, seed: int) -> RecoveryOptions:
        """This group as pip_core's recovery takes it, with the run's text length and seed."""
        from pip_core.recovery import RecoveryOptions

        fields = self.model_dump(include={"steps", "rank", "lr", "batch_size", "kd_params", "temperature", "warmup",
                                          "decay"})
        return RecoveryOptions(**fields, max_length=max_length, seed=seed)


#: closed-form repair forms a config names (pip_core.repair.REPAIR_FORMS, and none)
RepairForm = Literal["none", "bias", "lstsq"]


class RepairSettings(_Group):
    """Closed-form repair of the width-pruned layers after each pruning step, before any training (pip_core.repair)."""

    form: RepairForm = Field("none", description="none | lstsq: ridge least-squares refit of each pruned layer's "
                             "output projections (o_proj, down_proj) against the dense model's outputs on the "
                             "calibration texts (blocks: a linear patch folded into the block before each gap) | "
                             "bias: FLAP's bias compensation (width units, where the family's config has a bias "
                             "switch)")
    ridge: float = Field(1e-2, ge=0.0, le=100.0, description="lstsq: ridge towards the pruned weights, as a share of "
                         "the mean diagonal of the inputs' Gram matrix")
    fit_bias: bool = Field(False, description="lstsq: also fit a bias (turns the family's bias switch on)")

    @property
    def enabled(self) -> bool:
        return self.form != "none"

    def options(self, max_length: int) -> RepairOptions:
        """This group as pip_core's repair takes it, with the run's text length."""
        from pip_core.repair import RepairOptions

        return RepairOptions(form=self.form, ridge=self.ridge, fit_bias=self.fit_bias, max_length=max_length)


class VocabSettings(_Group):
    """Vocabulary trimming before any unit is pruned (infra.vocab_source, pip_core.vocab_trim): its rows count towards
    the target, so the layers pay only the rest."""

    corpus: str | None = Field(None, description="keep only the tokens this corpus encodes to (with the tokens their "
                               "merges build on, the special and byte tokens): a .txt file (one text per paragraph), "
                               "a .jsonl file ('text' per line) or 'public' (the English text the install fetches); "
                               "the embedding and LM-head rows of the rest count towards the target")

    @property
    def enabled(self) -> bool:
        return self.corpus is not None


class ExportSettings(_Group):
    """Optional last stage: the registered version exported as GGUF child versions (flows.export)."""

    quant: tuple[str, ...] = Field((), description="GGUF weight types to export the final model in, e.g. f16,q8_0 "
                                   "(empty: no export); one child version each, measured against the dense model")
    registered_model_name: str | None = Field(None, description="registered model of the GGUF versions "
                                              "(default: <registered_model_name>-gguf)")

    @field_validator("quant", mode="before")
    @classmethod
    def _split_quants(cls, value: object) -> object:
        from infra.gguf_write import GgufExportError, check_quant

        items = [v for v in value.split(",") if v.strip()] if isinstance(value, str) else list(value or ())
        try:
            return tuple(dict.fromkeys(check_quant(str(v)) for v in items))
        except GgufExportError as exc:
            raise ValueError(str(exc)) from None


class ServingSettings(_Group):
    """The deployment: the KV cache a memory target counts, and the serving measurement of the flow."""

    context: int = Field(0, ge=0, le=10_000_000, description="serving context (tokens) whose KV cache a memory "
                         "target includes (0: weights only)")
    batch: int = Field(1, ge=1, le=100_000, description="serving batch whose KV cache a memory target includes")
    measure: bool = Field(True, description="measure dense and pruned serving speed in the flow")
    backend: Literal["auto", "transformers", "vllm"] = Field(
        "auto", description="auto (vLLM when installed and a GPU is present, else transformers) | transformers | vllm")
    prompts: int = Field(8, ge=1, le=4096, description="prompts measured (drawn from the held-out texts)")
    prompt_tokens: int = Field(32, ge=1, le=32_768, description="tokens per prompt")
    new_tokens: int = Field(16, ge=2, le=32_768, description="tokens generated per prompt")
    batch_sizes: tuple[int, ...] = Field((1, 8), description="batch sizes measured (latency p50/p95 at each)")
    repeats: int = Field(3, ge=1, le=1000, description="timed repeats per batch size (after one warm-up)")

    @field_validator("batch_sizes", mode="before")
    @classmethod
    def _split_sizes(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(int(v) for v in value.split(",") if v.strip())
        return value


class RuntimeSettings(_Group):
    """Where the model runs and in which dtype; every task that loads a model takes this group whole."""

    device: str = Field("auto", description="auto | cpu | cuda | cuda:N (auto: CUDA when present, else CPU)")
    dtype: str = Field("auto", description="auto | bfloat16 | float16 | float32 (auto: the checkpoint's own)")
    activation_budget: float | None = Field(
        0.5, ge=0, description="gradient checkpointing (scoring, recovery) when all layers' activations would "
        "exceed this fraction of the weights: a lower peak for some recomputation; null: only when memory is short")
    scoring_workers: int = Field(1, ge=1, le=1024, description="spread the calibration pairs of each scoring step "
                                 "over N Dask workers (a local cluster, one process each; one per GPU on a multi-GPU "
                                 "node); scores equal the single-process ones. 1 = score in this process")
    scoring_cluster: str | None = Field(None, description="address of an existing Dask scheduler (tcp://HOST:8786) "
                                        "to score on instead of a local cluster (dask-kubernetes, dask-jobqueue)")
    scoring_threads: int = Field(1, ge=1, description="torch threads per scoring worker of the local cluster")

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        from pip_core.placement import check_device_spec

        return check_device_spec(value)

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, value: str) -> str:
        from pip_core.placement import check_dtype_spec

        return check_dtype_spec(value)


#: flat spellings (older config files, CLI options) -> (group, field)
FLAT_KEYS: dict[str, tuple[str, str]] = {
    "wordlist": ("calibration", "wordlist"), "n_samples": ("calibration", "n_samples"),
    "heldout_samples": ("calibration", "heldout_samples"), "max_length": ("calibration", "max_length"),
    "perturb_rate": ("calibration", "perturb_rate"),
    "unit": ("scoring", "unit"), "method": ("scoring", "method"), "iterations": ("scoring", "iterations"),
    "width_mode": ("scoring", "width_mode"), "align": ("scoring", "align"), "width_split": ("scoring", "width_split"),
    "serve_context": ("serving", "context"), "serve_batch": ("serving", "batch"),
    "protect_first": ("scoring", "protect_first"), "protect_last": ("scoring", "protect_last"),
    "eval_tasks": ("evaluation", "tasks"), "eval_include_path": ("evaluation", "include_path"),
    "eval_limit": ("evaluation", "limit"), "max_kl": ("evaluation", "max_kl"),
    "max_ppl_ratio": ("evaluation", "max_ppl_ratio"), "min_distinct_ratio": ("evaluation", "min_distinct_ratio"),
    "device": ("runtime", "device"), "dtype": ("runtime", "dtype"), "vocab_corpus": ("vocab", "corpus"),
}


class CompressConfig(BaseModel):
    """Everything that determines the output of a compress run, in groups passed whole."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Hugging Face hub id or local directory of a causal LM")
    ratio: float = Field(0.2, description=f"fraction of the source model's parameters to remove, in (0, {MAX_RATIO}] "
                         "(short for --target ratio=R)")
    target: str | None = Field(None, description="budget: params=N (at most N parameters, e.g. 3e9), memory=SIZE "
                               "(weights in the output dtype + the KV cache at --serve-context/--serve-batch, e.g. "
                               "24GiB), ratio=R or layers=R (a share of the decoder layers' parameters alone); "
                               "planned from config.json before any weights are read")
    allow_deep_cut: bool = Field(False, description="run a target that takes more than half of the decoder layers' "
                                 "parameters (or of their MLP channels, KV groups or number); without it such a "
                                 "target stops before any work, naming the alternatives")
    seed: int = Field(0, description="seed of sampling, perturbation and random scores")
    calibration: CalibrationSettings
    scoring: ScoringSettings = ScoringSettings()
    evaluation: EvaluationSettings = EvaluationSettings()
    vocab: VocabSettings = VocabSettings()
    repair: RepairSettings = RepairSettings()
    recovery: RecoverySettings = RecoverySettings()
    serving: ServingSettings = ServingSettings()
    runtime: RuntimeSettings = RuntimeSettings()
    export: ExportSettings = ExportSettings()
    registered_model_name: str = Field("pipprune-model", description="registered model name in MLflow")
    trust_remote_code: bool = False

    @model_validator(mode="before")
    @classmethod
    def _group_flat_keys(cls, data: object) -> object:
        """Accept flat keys (`n_samples: 8`, `calibration: path`) beside the grouped form, then apply the job's
        defaults rule (`job_defaults`) to what was not given."""
        if not isinstance(data, dict):
            return data
        data = {k: _given(v) for k, v in data.items()}
        if isinstance(data.get("calibration"), str):
            data["calibration"] = {"source": data["calibration"]}
        if isinstance(data.get("repair"), str):  # `repair: lstsq`, `--repair lstsq`
            data["repair"] = {"form": data["repair"]}
        if isinstance(data.get("vocab"), str):  # `vocab: public`
            data["vocab"] = {"corpus": data["vocab"]}
        for flat, (group, field) in FLAT_KEYS.items():
            if flat in data:
                value = data.pop(flat)
                data[group] = {**(data.get(group) or {}), field: value}
        data = job_defaults(data)
        target = data.get("target")
        if isinstance(target, str) and target.strip().lower().startswith("ratio="):  # one spelling: ratio=R is --ratio R
            from pip_core.budget import Target
            from pip_core.errors import PipCoreError

            try:
                value = Target.parse(target).value
            except PipCoreError as exc:
                raise ValueError(str(exc)) from None
            if data.get("ratio") is not None:
                raise ValueError(f"give --ratio or --target, not both (ratio {data['ratio']}, target {target})")
            data["ratio"], data["target"] = value, None
        return data

    @field_validator("ratio")
    @classmethod
    def _check_ratio(cls, value: float) -> float:
        if math.isnan(value) or not 0.0 < value <= MAX_RATIO:
            raise ValueError(f"ratio must be in (0, {MAX_RATIO}], got {value}")
        return value

    @field_validator("target")
    @classmethod
    def _check_target(cls, value: str | None) -> str | None:
        from pip_core.budget import Target
        from pip_core.errors import PipCoreError

        if value is None:
            return None
        try:
            return str(Target.parse(value))
        except PipCoreError as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _exportable_widths(self) -> CompressConfig:
        if self.export.quant and self.scoring.width_mode == "per_layer" and self.scoring.unit != "block":
            raise ValueError("export: GGUF keeps one attention and MLP width for every layer; per-layer widths cannot "
                             "be exported (use scoring.width_mode uniform, or no export)")
        return self

    @model_validator(mode="after")
    def _exportable_repair(self) -> CompressConfig:
        if self.export.quant and (self.repair.form == "bias" or (self.repair.form == "lstsq" and self.repair.fit_bias)):
            raise ValueError("export: the bias repair (and fit_bias) turns on the family's bias switches "
                             "(attention_bias, mlp_bias), which GGUF metadata cannot state (transformers' GGUF reader "
                             "rebuilds the model without those biases); use repair lstsq without fit_bias, or no export")
        return self

    @model_validator(mode="after")
    def _repair_fits_the_unit(self) -> CompressConfig:
        if self.repair.form == "bias" and self.scoring.unit == "block":
            raise ValueError("repair: bias compensates the columns a width cut removed; whole blocks removed are "
                             "patched by repair lstsq (a linear map folded into the block before each gap)")
        return self

    @model_validator(mode="after")
    def _one_budget(self) -> CompressConfig:
        if self.target is not None and "ratio" in self.model_fields_set:
            raise ValueError(f"give --ratio or --target, not both (ratio {self.ratio}, target {self.target})")
        return self

    def budget_target(self) -> str:
        """The budget as `pip_core.budget.Target` spells it (`--ratio R` is `ratio=R`)."""
        return self.target or f"ratio={self.ratio:g}"

    @field_validator("registered_model_name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not value or len(value) > 200 or any(c in value for c in "/\\:%"):
            raise ValueError(f"invalid registered model name {value!r}")
        return value

    def digest(self) -> str:
        """Stable hash of all settings (recorded in lineage)."""
        payload = self.model_dump(mode="json")
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def result_defining(self) -> dict:
        """The settings that decide the pruned weights: where inputs live and how they are evaluated do not."""
        # the vocabulary's corpus is a location: what it kept is in the trimmed source's fingerprint, which keys the run
        payload = self.model_dump(mode="json", exclude={"model", "evaluation", "registered_model_name", "export",
                                                        "vocab"})
        payload["calibration"] = {k: v for k, v in payload["calibration"].items() if k not in ("source", "wordlist")}
        payload["serving"] = {k: payload["serving"][k] for k in ("context", "batch")}  # what a memory budget counts
        payload["runtime"] = {k: payload["runtime"][k] for k in ("device", "dtype")}  # where scoring runs does not
        return payload


def _given(value: object) -> object:
    """A group given as an object counts only its explicitly set fields as given (the rest may take defaults)."""
    return value.model_dump(include=value.model_fields_set) if isinstance(value, _Group) else value


#: the lm-eval task of the built-in evaluation kit (tasks.evaluation builds it from Debian's WordNet on first use)
BUILTIN_CLOZE_TASK = "pipprune_wordnet_cloze"
#: its items per run: +/-0.08 on accuracy at 95%, a few seconds per model on a CPU
BUILTIN_CLOZE_LIMIT = 100


#: how many texts a run on the model's own texts samples, where the user did not say: sampling is its costliest
#: input (one decode loop of all texts, ~270 MFLOP a token on SmolLM2-135M), and a forward-only criterion's statistic
#: (a norm per input channel) is settled by 64 x 128 tokens; the recovery trains on texts of its own
#: (benchmarks/results/first_run.md measures the whole run)
OWN_TEXT_COUNTS = {"n_samples": 64, "recovery_samples": 64}
#: re-scored steps of a width cut on the model's own texts: structured Wanda at 20% of SmolLM2-135M gave a general
#: held-out perplexity ratio of 25.0 in one step, 1.883 in two, 1.873 in four (benchmarks/results/history.md);
#: three keeps a step away from that cliff for a third less than four
OWN_TEXT_WIDTH_ITERATIONS = 3
def own_text_defaults(unit: str | None) -> dict[str, dict]:
    """What a run gets when every calibration text is the model's own, where the user did not say otherwise.

    From the real model's figures (benchmarks/results, docs/calibration.md): width units scored by structured Wanda
    (forward only, the lowest KL of the width methods on both held-out sets), whole blocks by ShortGPT's block
    influence (better than every PIP block form), then distillation from the dense model on texts it sampled apart
    from the scored ones.
    """
    scoring = {"method": "block_influence"} if unit == "block" else {"method": "wanda_sp",
                                                                       "iterations": OWN_TEXT_WIDTH_ITERATIONS}
    return {"scoring": scoring,
            "calibration": dict(OWN_TEXT_COUNTS),
            "recovery": {"steps": DEFAULT_RECOVERY_STEPS, "kind": "kd"}}


def job_defaults(data: dict) -> dict:
    """The one defaults rule of a compress job, on the grouped fields the user gave (CLI options or a config file).

    - calibration: a model directory laid out as a reference build calibrates on its own corpus; any other model
      (a GGUF file, a hub id, a plain directory) on texts it samples itself (`self`);
    - when every calibration text is the model's own (given or implied), `own_text_defaults` fills the method and the
      recovery fields not given (a partial recovery group merges with the default one);
    - lm-eval: a reference build's own tasks (the model's, else the calibration source's), else the built-in WordNet
      cloze task.
    Only what is absent is filled, so a value the user set always wins.
    """
    model = data.get("model")
    calibration = dict(data.get("calibration") or {})
    if calibration.get("source") is None and isinstance(model, str):
        calibration["source"] = model if model_dir_layout(model).has_calibration() else SELF
    data = {**data, "calibration": calibration}
    try:
        spec = CalibrationSpec.parse(calibration["source"]) if calibration.get("source") is not None else None
    except ValueError:
        spec = None  # the field's own validator names the problem
    if spec is not None and spec.is_self:
        scoring = data.get("scoring") or {}
        unit = implied_unit(scoring.get("unit"), scoring.get("method"))  # as ScoringSettings infers it
        for group, defaults in own_text_defaults(unit).items():
            data[group] = {**defaults, **(data.get(group) or {})}
    evaluation = dict(data.get("evaluation") or {})
    if evaluation.get("tasks") is None and evaluation.get("include_path") is None:
        data["evaluation"] = {**_default_eval(model, spec), **{k: v for k, v in evaluation.items() if v is not None}}
    return data


def _default_eval(model: object, spec: CalibrationSpec | None) -> dict:
    """The lm-eval tasks a run gets when it names none, and why (shown in the summary)."""
    candidates = [(model, "the model is a pipprune reference build")] if isinstance(model, str) else []
    if spec is not None and spec.single_file:
        candidates.append((spec.single_file, "the calibration source is a pipprune reference build"))
    for candidate, why in candidates:
        layout = model_dir_layout(candidate)
        if names := layout.task_names():
            return {"tasks": tuple(names), "include_path": str(layout.tasks.resolve()),
                    "tasks_origin": f"{why}: its local tasks in {layout.tasks.resolve()}"}
    return {"tasks": (BUILTIN_CLOZE_TASK,), "limit": BUILTIN_CLOZE_LIMIT,
            "tasks_origin": "the built-in evaluation kit (WordNet cloze, from Debian's wordnet-base): no --tasks given "
                            "and the model is not a reference build"}


def read_yaml_mapping(path: Path, what: str) -> dict:
    """A YAML/JSON file holding a mapping; a syntax error becomes one line naming the file, line and column."""
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"{what} {path}: YAML syntax error{where}: {problem}; fix the file") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not UTF-8 text") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} must hold a mapping (key: value lines), got {type(data).__name__}")
    return data


def load_config_file(path: Path, **overrides: object) -> CompressConfig:
    """Read a YAML/JSON config file; CLI values given explicitly override file values."""
    data = read_yaml_mapping(path, "config file")
    for key, value in overrides.items():
        if value is None:
            continue
        group, field = FLAT_KEYS.get(key, (None, None))
        if group is not None and isinstance(data.get(group), dict):
            data[group] = {**data[group], field: value}
        elif isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}  # e.g. --recovery-steps keeps the file's recovery.rank
        elif key == "calibration" and isinstance(data.get(key), dict):
            data[key] = {**data[key], "source": value}
        else:
            data[key] = value
    return CompressConfig(**data)
