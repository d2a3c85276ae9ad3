"""Closed-form repair of width-pruned layers from calibration activations, before any training (issue 48).

Removing a KV group or an MLP channel removes columns of the module that consumes its output (o_proj, down_proj:
the family's dim-1 slot), and each layer's output drifts from the dense model's. Two published repairs, with no
gradient:

- "lstsq" (SlimGPT 2412.18110, ZipLM 2302.04089, Olica 2506.08436): refit the consumer's kept columns so that it
  reproduces the dense consumer's output, W' = argmin ||W' X_p - Y_d||^2 + lam ||W' - W_p||^2, X_p its inputs in the
  pruned model, Y_d the dense consumer's outputs on the same tokens, W_p the kept columns as pruning left them (the
  ridge pulls towards the layer as it is, not towards zero). The Gram matrices X_p X_p^T and Y_d X_p^T are summed
  over the tokens in float64, so memory is the layer's, not the data's.
- "bias" (FLAP 2312.11983): the consumer's bias += W_d[:, pruned] @ mean(x_d[pruned]), the mean of what the
  removed columns used to add. It needs a bias, so only where the family's config has a switch giving the
  consumer one (`Family.bias_switches`); the switch's other biases are zeros, and the stock class still loads it.

Layers are repaired in order, each on the states that the repaired layers before it give: both models' hidden
states at the current layer are kept for every calibration text, each layer of each model is run on its own
model's states, one consumer's inputs are gathered per pass (the attention's refit changes the MLP's inputs),
and the pruned layer is run once more for its output. About three forwards of the calibration set in all.

Block-pruned models (fewer layers than the dense one) are handed to `pip_core.block_patch`, which folds a linear
patch for each gap into the block before it.

Which columns were kept is read from the weights (`kept_columns`): pruning copies kept columns unchanged, so each
matches one dense column exactly after any number of pruning steps, and no index has to travel from the prune
step through the flow. Only the bias form needs them; lstsq needs only the dense model's outputs.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from pip_core import families
from pip_core.errors import CalibrationError, PipCoreError
from pip_core.families import Family
from pip_core.units import check_supported

log = logging.getLogger(__name__)

#: "lstsq": ridge least-squares refit of the kept columns; "bias": FLAP's bias compensation
REPAIR_FORMS = ("lstsq", "bias")


class RepairError(PipCoreError):
    """A repair that cannot be done: models that do not correspond, a bias the family cannot hold, bad options."""


@dataclass(frozen=True)
class RepairOptions:
    """How `repair` refits the pruned consumers (passed whole)."""

    #: one of REPAIR_FORMS
    form: str = "lstsq"
    #: lstsq: lam = ridge x the mean diagonal of the kept inputs' Gram matrix (scale-free; 0: plain least squares),
    #: pulling the refit towards the pruned weights (GramStats.solve)
    ridge: float = 1e-2
    #: lstsq: also fit a bias (an augmented row of ones), switching the family's bias flag on; a consumer that has
    #: a bias already always has it refitted with its columns
    fit_bias: bool = False
    #: lstsq: weight each token by 1 / ||its dense output||^2 (fit relative errors, so massive activations do not
    #: dominate the fit: GramStats.add); off by default: on SmolLM2-135M it was worse than the plain fit (the
    #: massive positions are attention sinks whose outputs matter; benchmarks/results/history.md)
    relative: bool = False
    #: calibration texts per padded batch
    batch_size: int = 16
    #: tokens kept of each text
    max_length: int = 128
    progress: bool = False

    def check(self) -> None:
        if self.form not in REPAIR_FORMS:
            raise RepairError(f"unknown repair form {self.form!r}; use one of {', '.join(REPAIR_FORMS)}")
        if not self.ridge >= 0:
            raise RepairError(f"ridge must be >= 0, got {self.ridge}")
        if self.batch_size < 1 or self.max_length < 1:
            raise RepairError(f"batch_size and max_length must be >= 1, got {self.batch_size}, {self.max_length}")


@dataclass(frozen=True)
class Consumer:
    """A module of layer `layer` whose input columns belong to `kind` units (o_proj for attn, down_proj for mlp)."""

    layer: int
    kind: str
    module: str


@dataclass(frozen=True)
class ConsumerRepair:
    """One repaired consumer: its width against the dense one, and ||W X_p - Y_d|| / ||Y_d|| on the calibration
    tokens before and after (the MLP's X_p is its input once the layer's attention is repaired)."""

    layer: int
    module: str
    columns: int
    dense_columns: int
    error_before: float
    error_after: float


@dataclass
class RepairReport:
    form: str
    #: calibration tokens the statistics sum over (pads excluded)
    tokens: int
    consumers: list[ConsumerRepair] = field(default_factory=list)
    #: config flags turned on to give consumers a bias ("mlp_bias", ...)
    bias_switches: list[str] = field(default_factory=list)
    seconds: float = 0.0


# ---------------------------------------------------------------- which consumers, which columns

def consumers(family: Family, layer: int) -> list[Consumer]:
    """The layer's consumers in forward order (the attention's before the MLP's)."""
    return [Consumer(layer, kind, slot.module) for kind in ("attn", "mlp") for slot in family.slots(kind) if slot.dim == 1]


def lost_inputs(pruned: nn.Module, dense: nn.Module) -> list[Consumer]:
    """The consumers of `pruned` with fewer input columns than the same module of `dense`, layer by layer."""
    family = _check_pair(pruned, dense)
    out = []
    p_layers, d_layers = families.decoder_layers(pruned, family), families.decoder_layers(dense, family)
    for i, (p_layer, d_layer) in enumerate(zip(p_layers, d_layers, strict=True)):
        for c in consumers(family, i):
            p, d = (families.get_module(x, c.module).weight.shape[1] for x in (p_layer, d_layer))
            if p > d:
                raise RepairError(f"layer {i} {c.module} has {p} input columns, the dense model's {d}: not its pruned "
                                  "copy")
            if p < d:
                out.append(c)
    return out


def _check_pair(pruned: nn.Module, dense: nn.Module) -> Family:
    family = check_supported(pruned)
    if check_supported(dense) != family:
        raise RepairError(f"the dense model is a {dense.config.model_type}, the pruned one a {pruned.config.model_type}")
    p_layers, d_layers = families.decoder_layers(pruned, family), families.decoder_layers(dense, family)
    if len(p_layers) != len(d_layers):
        raise RepairError(f"the pruned model has {len(p_layers)} decoder layers, the dense one {len(d_layers)}: the "
                          "width repair matches layer i to layer i (a block-pruned model has fewer layers, and is "
                          "patched by pip_core.block_patch)")
    return family


def kept_columns(pruned_weight: torch.Tensor, dense_weight: torch.Tensor) -> torch.Tensor:
    """Index of the dense column each pruned column is an exact copy of (pruning copies kept columns unchanged).

    Equal dense columns are handed out in order, one each. A column without an exact copy means the weights
    changed after pruning (trained, quantized): the indices cannot be recovered and RepairError says so.
    """
    if pruned_weight.shape[0] != dense_weight.shape[0]:
        raise RepairError(f"weights of {pruned_weight.shape[0]} and {dense_weight.shape[0]} rows are not one consumer")
    dense_cols = dense_weight.detach().t().float().cpu().contiguous()
    where: dict[bytes, list[int]] = defaultdict(list)
    for j, col in enumerate(dense_cols):
        where[col.numpy().tobytes()].append(j)
    kept = []
    for j, col in enumerate(pruned_weight.detach().t().float().cpu().contiguous()):
        free = where.get(col.numpy().tobytes())
        if not free:
            raise RepairError(f"pruned column {j} is no column of the dense weight: the weights changed after pruning "
                              "(repair runs right after the prune step, before any training)")
        kept.append(free.pop(0))
    return torch.tensor(kept, dtype=torch.long)


def flap_compensation(dense_weight: torch.Tensor, kept: torch.Tensor, dense_mean: torch.Tensor) -> torch.Tensor:
    """FLAP's bias term: the removed columns times the mean of their dense inputs, W_d[:, pruned] @ mean[pruned]."""
    pruned = torch.ones(dense_weight.shape[1], dtype=torch.bool)
    pruned[kept] = False
    pruned = pruned.to(dense_weight.device)
    return dense_weight.detach().double()[:, pruned] @ dense_mean.double().to(dense_weight.device)[pruned]


# ---------------------------------------------------------------- streaming statistics and the solve

def token_weights(y: torch.Tensor) -> torch.Tensor:
    """1 / ||y_t||^2 per token (the target's squared norm, floored at 1e-6 of the mean).

    Why: a few positions carry massive activations (SmolLM2-135M: the first token's down_proj output in layer 28 has
    a norm of ~14,000 against ~190 for the others), so a plain least-squares fit spends almost all of its objective
    on them and degrades every other token; weighting by the inverse squared norm fits each token's relative error.
    """
    squared = y.pow(2).sum(-1)
    return 1.0 / squared.clamp_min(1e-6 * float(squared.mean()) + 1e-30)


class GramStats:
    """Sums over tokens of [x;1][x;1]^T, y [x;1]^T and ||y||^2 in float64: all the refit and its error need."""

    def __init__(self, columns: int, outputs: int, device: torch.device | str = "cpu") -> None:
        self.g = torch.zeros(columns + 1, columns + 1, dtype=torch.float64, device=device)
        self.c = torch.zeros(outputs, columns + 1, dtype=torch.float64, device=device)
        self.yy = torch.zeros((), dtype=torch.float64, device=device)
        self.tokens = 0

    def add(self, x: torch.Tensor, y: torch.Tensor, relative: bool = False) -> None:
        """`x` (tokens, columns) inputs, `y` (tokens, outputs) targets, real positions only. `relative`: each token
        weighted by 1 / ||y_t||^2, so the fit minimises every token's relative error alike (`token_weights`)."""
        x, y = x.to(self.g.device, torch.float64), y.to(self.g.device, torch.float64)
        if relative:
            w = token_weights(y).sqrt()[:, None]
            x, y = x * w, y * w
            ones = w
        else:
            ones = x.new_ones(x.shape[0], 1)
        xa = torch.cat([x, ones], dim=1)
        self.g += xa.T @ xa
        self.c += y.T @ xa
        self.yy += y.pow(2).sum()
        self.tokens += int(x.shape[0])

    def solve(self, ridge: float, with_bias: bool, prior: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """argmin ||W X + b - Y||^2 + lam ||W - prior||^2 (b only `with_bias`, never penalised; prior None: 0),
        lam = ridge x the mean diagonal of the inputs' Gram matrix.

        The repair passes the weights it replaces as `prior`: the ridge then pulls the refit towards the pruned layer
        as it is, not towards zero (which shrinks the layer's output), so a strong ridge means "change little"
        rather than "output less", and the data moves only what it determines.
        """
        n = self.g.shape[0] - 1
        size = n + 1 if with_bias else n
        lhs = self.g[:size, :size].clone()
        lam = ridge * float(self.g[:n, :n].diagonal().mean())
        lhs[:n, :n] += lam * torch.eye(n, dtype=torch.float64, device=lhs.device)
        rhs = self.c[:, :size].clone()
        if prior is not None:
            rhs[:, :n] += lam * prior.to(rhs.device, torch.float64)
        try:
            solution = torch.linalg.solve(lhs, rhs.T).T  # lhs is symmetric: (C M^-1)^T = M^-1 C^T
        except RuntimeError as exc:  # torch.linalg.LinAlgError: singular without a ridge
            raise RepairError(f"the inputs' Gram matrix is singular ({exc}); use a ridge > 0") from None
        return solution[:, :n], (solution[:, n] if with_bias else None)

    def error(self, weight: torch.Tensor, bias: torch.Tensor | None) -> float:
        """||W X + b - Y|| / ||Y|| over the summed tokens, from the sums alone."""
        a = torch.cat([weight.to(self.g.device, torch.float64),
                       (bias.to(self.g.device, torch.float64) if bias is not None
                        else weight.new_zeros(weight.shape[0], dtype=torch.float64, device=self.g.device))[:, None]], 1)
        squared = (a @ self.g * a).sum() - 2 * (a * self.c).sum() + self.yy
        return float(squared.clamp_min(0).sqrt() / self.yy.sqrt().clamp_min(1e-300))


# ---------------------------------------------------------------- batches and layer-by-layer passes

@dataclass(frozen=True)
class _Batch:
    ids: torch.Tensor
    #: real (not pad) positions, rows x positions
    mask: torch.Tensor


def _batches(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], options: RepairOptions) -> list[_Batch]:
    """Right-padded batches, longest texts first (little padding); pads are masked out of every statistic."""
    seqs = [tokenizer(t, truncation=True, max_length=options.max_length, return_tensors="pt")["input_ids"][0]
            for t in texts]
    seqs = sorted((s for s in seqs if s.numel()), key=len, reverse=True)
    if not seqs:
        raise CalibrationError("repair needs calibration texts, and none has a token")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = []
    for start in range(0, len(seqs), options.batch_size):
        chunk = seqs[start:start + options.batch_size]
        ids = torch.full((len(chunk), len(chunk[0])), pad, dtype=torch.long)
        mask = torch.zeros(ids.shape, dtype=torch.bool)
        for row, s in enumerate(chunk):
            ids[row, :len(s)], mask[row, :len(s)] = s, True
        out.append(_Batch(ids, mask))
    return out


@contextmanager
def evaluating(*models: nn.Module) -> Iterator[None]:
    """Every model in eval mode inside the block, each back in its own mode after."""
    modes = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(models, modes, strict=True):
            m.train(mode)


#: a layer call's arguments after the hidden states: (positional, keyword)
Call = tuple[tuple, dict[str, Any]]


@contextmanager
def _recording_layers(layers: nn.ModuleList, calls: list[Call | None], first: list[torch.Tensor]) -> Iterator[None]:
    """Every layer becomes the identity and records its arguments (masks, rotary tables: what the model computes
    for each layer, per layer type where a family mixes them); layer 0 also records its input states."""
    def recorder(i: int):
        def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            hidden = args[0] if args else kwargs.pop("hidden_states")
            calls[i] = (tuple(args[1:]), kwargs)
            if i == 0:
                first.append(hidden.detach())
            return hidden
        return forward

    for i, layer in enumerate(layers):
        layer.forward = recorder(i)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def _layer_inputs(model: nn.Module, family: Family, batches: Sequence[_Batch]) -> tuple[list[torch.Tensor], list[list[Call]]]:
    """Per batch, the states entering layer 0 and every layer's other arguments (an embedding pass, no layer run)."""
    layers = families.decoder_layers(model, family)
    states: list[torch.Tensor] = []
    calls: list[list[Call]] = []
    for batch in batches:
        per_layer: list[Call | None] = [None] * len(layers)
        with _recording_layers(layers, per_layer, states):
            _decoder(model, family, batch)
        calls.append(per_layer)
    return states, calls


def _decoder(model: nn.Module, family: Family, batch: _Batch) -> None:
    """The decoder stack alone on `batch` (no LM head: only the layers are read)."""
    device = next(model.parameters()).device
    decoder = model.get_submodule(family.layers.rpartition(".")[0])
    decoder(input_ids=batch.ids.to(device), attention_mask=batch.mask.long().to(device), use_cache=False)


def _run(layer: nn.Module, hidden: torch.Tensor, call: Call) -> torch.Tensor:
    out = layer(hidden, *call[0], **call[1])
    return out[0] if isinstance(out, tuple) else out


class _Stop(Exception):
    """Raised by a hook once it has what it needs: the rest of the layer is not run."""


def _dense_pass(layer: nn.Module, targets: Sequence[Consumer], states: list[torch.Tensor], calls: list[Call],
                batches: Sequence[_Batch]) -> tuple[list[torch.Tensor], dict[Consumer, list[torch.Tensor]],
                                                    dict[Consumer, torch.Tensor]]:
    """Run a dense layer on every batch: its output states, each target consumer's outputs per batch (real positions)
    and the mean of its inputs (FLAP's baseline)."""
    outputs: dict[Consumer, list[torch.Tensor]] = defaultdict(list)
    sums: dict[Consumer, torch.Tensor] = {}
    count = 0
    mask: list[torch.Tensor] = []

    def hook(c: Consumer):
        def capture(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            real = mask[0].to(output.device)
            outputs[c].append(output[real].detach())
            sums[c] = sums.get(c, 0) + args[0][real].double().sum(0)
        return capture

    handles = [families.get_module(layer, c.module).register_forward_hook(hook(c)) for c in targets]
    new_states = []
    try:
        for hidden, call, batch in zip(states, calls, batches, strict=True):
            mask[:] = [batch.mask]
            count += int(batch.mask.sum())
            new_states.append(_run(layer, hidden, call))
    finally:
        for h in handles:
            h.remove()
    return new_states, outputs, {c: s / count for c, s in sums.items()}


def _pruned_stats(layer: nn.Module, consumer: Consumer, targets: list[torch.Tensor], states: list[torch.Tensor],
                  calls: list[Call], batches: Sequence[_Batch], relative: bool = False) -> GramStats:
    """The consumer's inputs in the pruned layer against the dense outputs, summed over every batch; the layer
    stops at the consumer."""
    module = families.get_module(layer, consumer.module)
    stats = GramStats(module.weight.shape[1], module.weight.shape[0], module.weight.device)
    now: list[tuple[torch.Tensor, torch.Tensor]] = []

    def capture(module: nn.Module, args: tuple) -> None:
        mask, target = now[0]
        stats.add(args[0][mask.to(args[0].device)], target, relative=relative)
        raise _Stop

    handle = module.register_forward_pre_hook(capture)
    try:
        for hidden, call, batch, target in zip(states, calls, batches, targets, strict=True):
            now[:] = [(batch.mask, target)]
            try:
                _run(layer, hidden, call)
            except _Stop:
                pass
    finally:
        handle.remove()
    return stats


# ---------------------------------------------------------------- biases and the repair

def _give_biases(model: nn.Module, family: Family, kinds: set[str]) -> list[str]:
    """Turn on the config switch of each kind whose consumer has no bias, with zero biases for every Linear slot it
    covers (what the stock class then builds), so the model saves and loads as before. Refused, before any change,
    where such a kind has no switch."""
    layers = families.decoder_layers(model, family)
    wanted = [(kind, c.module) for c in consumers(family, 0) for kind in sorted(kinds) if c.kind == kind
              and any(families.get_module(layer, c.module).bias is None for layer in layers)]
    for kind, module in wanted:
        if family.bias_switch(kind) is None:
            raise RepairError(f"the {family.model_type} family has no config switch giving {module} a bias, so the "
                              "bias form (and fit_bias) cannot repair it; use form 'lstsq'")
    for kind, _ in wanted:
        for layer in layers:
            for slot in family.slots(kind):
                module = families.get_module(layer, slot.module)
                if isinstance(module, nn.Linear) and module.bias is None:
                    w = module.weight
                    module.bias = nn.Parameter(w.new_zeros(w.shape[0]), requires_grad=w.requires_grad)
        setattr(model.config, family.bias_switch(kind), True)
    return [family.bias_switch(kind) for kind, _ in wanted]


def _refit(p_module: nn.Linear, d_module: nn.Linear, stats: GramStats, dense_mean: torch.Tensor,
           options: RepairOptions) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The consumer's new weight and bias."""
    bias = p_module.bias
    if options.form == "lstsq":
        return stats.solve(options.ridge, with_bias=bias is not None, prior=p_module.weight.detach())
    kept = kept_columns(p_module.weight, d_module.weight)
    return p_module.weight.detach(), bias.detach().double() + flap_compensation(d_module.weight, kept, dense_mean)


@torch.no_grad()
def repair(pruned: nn.Module, dense: nn.Module, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str],
           options: RepairOptions = RepairOptions()) -> RepairReport:
    """Repair, in place, every consumer of `pruned` that lost input columns against `dense` (its unpruned source),
    on the calibration `texts`; layers that lost nothing are left as they are. See the module docstring. A model with
    fewer blocks than `dense` is block-pruned: its gaps get the linear patch of `pip_core.block_patch` instead."""
    family = check_supported(pruned)
    if len(families.decoder_layers(pruned, family)) < len(families.decoder_layers(dense, family)):
        from pip_core.block_patch import patch_blocks

        return patch_blocks(pruned, dense, tokenizer, texts, options)
    start = time.perf_counter()
    options.check()
    family = _check_pair(pruned, dense)
    targets = lost_inputs(pruned, dense)
    batches = _batches(tokenizer, texts, options)
    wants_bias = options.form == "bias" or options.fit_bias
    switched = _give_biases(pruned, family, {c.kind for c in targets}) if wants_bias else []
    report = RepairReport(form=options.form, tokens=sum(int(b.mask.sum()) for b in batches), bias_switches=switched)
    if not targets:
        return report
    with evaluating(pruned, dense):
        d_states, d_calls = _layer_inputs(dense, family, batches)
        p_states, p_calls = _layer_inputs(pruned, family, batches)
        p_layers, d_layers = families.decoder_layers(pruned, family), families.decoder_layers(dense, family)
        last = max(c.layer for c in targets)  # the layers after it need no states
        for i in tqdm(range(last + 1), desc=f"repair ({options.form})", disable=not options.progress):
            mine = [c for c in targets if c.layer == i]
            layer_calls_d, layer_calls_p = [c[i] for c in d_calls], [c[i] for c in p_calls]
            d_states, outputs, means = _dense_pass(d_layers[i], mine, d_states, layer_calls_d, batches)
            for c in mine:
                report.consumers.append(_repair_consumer(c, p_layers[i], d_layers[i], outputs.pop(c), means[c], p_states,
                                                         layer_calls_p, batches, options))
            p_states = [_run(p_layers[i], h, call) for h, call in zip(p_states, layer_calls_p, strict=True)]
    report.seconds = time.perf_counter() - start
    return report


def _repair_consumer(c: Consumer, p_layer: nn.Module, d_layer: nn.Module, outputs: list[torch.Tensor],
                     dense_mean: torch.Tensor, p_states: list[torch.Tensor], calls: list[Call], batches: Sequence[_Batch],
                     options: RepairOptions) -> ConsumerRepair:
    p_module, d_module = families.get_module(p_layer, c.module), families.get_module(d_layer, c.module)
    stats = _pruned_stats(p_layer, c, outputs, p_states, calls, batches, options.relative)
    before = stats.error(p_module.weight.detach(), p_module.bias)
    weight, bias = _refit(p_module, d_module, stats, dense_mean, options)
    after = stats.error(weight, bias)
    p_module.weight.copy_(weight.to(p_module.weight.dtype))
    if bias is not None:
        p_module.bias.copy_(bias.to(p_module.bias.dtype))
    log.info("repair layer %d %s: error %.4f -> %.4f", c.layer, c.module, before, after)
    return ConsumerRepair(layer=c.layer, module=c.module, columns=p_module.weight.shape[1],
                          dense_columns=d_module.weight.shape[1], error_before=before, error_after=after)


# ---------------------------------------------------------------- measurement on other texts

@torch.no_grad()
def consumer_errors(pruned: nn.Module, dense: nn.Module, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str],
                    options: RepairOptions = RepairOptions()) -> dict[tuple[int, str], float]:
    """||Y_p - Y_d|| / ||Y_d|| of every consumer's output, each model run whole on `texts` (held-out texts: how far
    each layer of the pruned model is from the dense one, end to end)."""
    family = _check_pair(pruned, dense)
    every = [c for i in range(len(families.decoder_layers(dense, family))) for c in consumers(family, i)]
    squares = {c: [0.0, 0.0] for c in every}
    for batch in _batches(tokenizer, texts, options):
        reference: dict[Consumer, torch.Tensor] = {}

        def keep(c: Consumer, y: torch.Tensor, reference: dict = reference) -> None:
            reference[c] = y

        def compare(c: Consumer, y: torch.Tensor, reference: dict = reference) -> None:
            ref = reference.pop(c).to(y.device)
            squares[c][0] += float((y - ref).pow(2).sum())
            squares[c][1] += float(ref.pow(2).sum())

        _consumer_outputs(dense, family, every, batch, keep)
        _consumer_outputs(pruned, family, every, batch, compare)
    return {(c.layer, c.module): (err / max(ref, 1e-300)) ** 0.5 for c, (err, ref) in squares.items()}


def _consumer_outputs(model: nn.Module, family: Family, every: Sequence[Consumer], batch: _Batch,
                      sink: Callable[[Consumer, torch.Tensor], None]) -> None:
    """Run the decoder on `batch`, handing each consumer's output at the real positions (float64) to `sink`."""
    layers = families.decoder_layers(model, family)

    def hook(c: Consumer):
        def capture(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            sink(c, output[batch.mask.to(output.device)].double())
        return capture

    handles = [families.get_module(layers[c.layer], c.module).register_forward_hook(hook(c)) for c in every]
    try:
        _decoder(model, family, batch)
    finally:
        for h in handles:
            h.remove()
