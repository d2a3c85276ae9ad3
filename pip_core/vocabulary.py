"""The words every layer shares: unit kinds, scoring methods and limits, defined once.

The config model, the CLI, the score-table schema and pip_core itself all read these, so a new
method or kind is added in one place.
"""

from __future__ import annotations

from typing import Literal, get_args

#: a structural unit that one score is given to
UnitKind = Literal["block", "attn", "mlp"]
#: what a user asks to prune: one unit kind, or `width` = attention groups and MLP channels together
PruneTarget = Literal["block", "attn", "mlp", "width"]
#: unit kinds that each prune target scores
KINDS: dict[str, tuple[str, ...]] = {"block": ("block",), "attn": ("attn",), "mlp": ("mlp",), "width": ("attn", "mlp")}

#: `pip` is PIP in its default form (importance.PIP_DEFAULT_FORM); `pip_l2` is the paper's literal
#: PertImport, `pip_first_order` sum |w * gradient difference|, `pip_removal` the first-order change of the
#: views' loss gap when a block is removed (blocks only), `pip_single_view` / `pip_removal_single_view` the
#: no-perturbation ablations (pip_core.importance says which forms were measured and removed); `minitron` and
#: `wanda_sp` are forward-only activation baselines for width units
Method = Literal["pip", "pip_l2", "pip_first_order", "pip_removal", "pip_removal_single_view", "pip_single_view",
                 "random", "magnitude", "taylor", "block_influence", "minitron", "wanda_sp"]
METHODS: tuple[str, ...] = get_args(Method)
#: CLI spellings accepted for methods (the design card writes "block-influence")
METHOD_ALIASES = {"block-influence": "block_influence"}
#: methods that score whole blocks only
BLOCK_ONLY_METHODS = frozenset({"block_influence", "pip_removal", "pip_removal_single_view"})
#: methods that score attention groups and MLP channels only
WIDTH_ONLY_METHODS = frozenset({"minitron", "wanda_sp"})
#: methods that read the perturbed view of a text (PIP's dual-view forms): only these need perturbed pairs and a
#: word list; the single-view ablations and every other method read the plain texts (or none)
PERTURBATION_METHODS = frozenset({"pip", "pip_l2", "pip_first_order", "pip_removal"})
#: methods that run the model forward only (no gradient): inference mode, padded batches, no checkpointing
FORWARD_ONLY_METHODS = frozenset({"block_influence", "minitron", "wanda_sp"})

#: how width units are cut: the same count in every layer (the family's stock config, loads anywhere),
#: or each layer its own count (custom config + modeling file)
WidthMode = Literal["uniform", "per_layer"]
WIDTH_MODES: tuple[str, ...] = get_args(WidthMode)
#: how a uniform width cut shares its parameters between attention and the MLP: in proportion to their parameters,
#: or the split whose removed units have the lowest standardised scores (pip_core.prune.select_uniform)
WidthSplit = Literal["params", "scores"]
WIDTH_SPLITS: tuple[str, ...] = get_args(WidthSplit)

#: what recovery trains on: LoRA on the LM loss, or distillation (KL on logits) from the dense model
RecoveryKind = Literal["lora", "kd"]
RECOVERY_KINDS: tuple[str, ...] = get_args(RecoveryKind)
#: weights a distillation trains: LoRA adapters merged back, every weight, or at full rank only the consumers (the
#: modules that read the pruned units: o_proj, down_proj) and the norms
KdParams = Literal["lora", "full", "consumers"]
KD_PARAMS: tuple[str, ...] = get_args(KdParams)

#: the largest fraction of parameters a run may remove
MAX_RATIO = 0.9
