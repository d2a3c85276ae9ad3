"""Unit importance: PIP's PertImport and the baselines, behind one `score` function.

PertImport(u) = mean over pairs of || grad_u L(s) - grad_u L(s~) ||. By linearity of the
gradient that difference is grad_u (L(s) - L(s~)), so each pair costs one forward of both views
(one padded batch of two) and ONE backward. Gradients are reduced to per-unit squared norms by
hooks the moment each parameter's gradient is ready and then freed, so no full gradient copy
is ever held.

Other forms of the same idea, kept where the real model's figures support them (benchmarks/results/README.md):
`pip_first_order` (sum |w * gradient difference|) and, for blocks, `pip_removal`, the first-order change of the
views' loss gap when a block is removed (activation gradients only); `pip_single_view` and
`pip_removal_single_view` are their no-perturbation ablations. Three more forms were measured and removed,
their results kept in benchmarks/results: `pip_relative` (the gradient difference over the clean view's
gradient, KL 11.6 at blocks 0.2 against block influence's 1.04), `pip_repr` / `pip_repr_cos` (the views'
hidden-state difference through each block, 4.95 / 8.01).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from pip_core import chunked_loss, families
from pip_core.errors import CalibrationError, PipCoreError
from pip_core.recompute import activation_checkpointing
from pip_core.units import Unit, check_supported, decoder_layers, family_of, unit_tensors
from pip_core.vocabulary import FORWARD_ONLY_METHODS, METHODS, PERTURBATION_METHODS, WIDTH_ONLY_METHODS

log = logging.getLogger(__name__)

#: the form `pip` uses for width units (attention groups, MLP channels; see pert_import and docs/quality.md's PIP
#: section for the evidence)
PIP_DEFAULT_FORM = "l2"
#: the form `pip` uses for whole blocks
PIP_DEFAULT_BLOCK_FORM = "l2"


def default_form(kind: str) -> str:
    """The PIP form `pip` means for units of `kind` ('block', 'attn', 'mlp' or 'width')."""
    return PIP_DEFAULT_BLOCK_FORM if kind == "block" else PIP_DEFAULT_FORM


# ---------------------------------------------------------------- tokenisation

def _encode(tokenizer, texts: Sequence[str], max_length: int) -> list[torch.Tensor]:  # noqa: ANN001
    """Token ids per text; texts under 2 tokens cannot give a next-token loss and are refused."""
    if len(texts) == 0:
        raise CalibrationError("empty calibration set: at least one text is needed")
    encoded = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise CalibrationError(f"calibration text {i} is {type(text).__name__}, not str")
        ids = tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")["input_ids"][0]
        if ids.numel() < 2:
            raise CalibrationError(f"calibration text {i} is shorter than 2 tokens: {text[:40]!r}")
        encoded.append(ids)
    return encoded


def _block_form_views(form: str, forms: Sequence[str], family_name: str, units: Sequence[Unit],
                      pairs: Sequence[tuple[str, str]], tokenizer, max_length: int) -> tuple[list, list]:  # noqa: ANN001
    """Both views' token ids for a block-only form, after refusing an unknown form, width units or no pairs."""
    if form not in forms:
        raise PipCoreError(f"unknown {family_name} form {form!r}; use one of {', '.join(forms)}")
    if any(u.kind != "block" for u in units):
        raise PipCoreError(f"pip_{form} scores whole blocks only; use unit kind 'block'")
    if not pairs:
        raise CalibrationError("empty calibration set: no (original, perturbed) pairs")
    return (_encode(tokenizer, [p[0] for p in pairs], max_length), _encode(tokenizer, [p[1] for p in pairs], max_length))


def _batch(seqs: Sequence[torch.Tensor], pad_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    width = max(s.numel() for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : s.numel()] = s
        mask[row, : s.numel()] = 1
    return ids.to(device), mask.to(device)


#: tokens in one padded batch of a forward-only criterion (rows = this // max_length, at least 1; never logits: the
#: decoder alone runs). Measured on SmolLM2-135M, structured Wanda over 64 texts of 128 tokens, 2 cores, 16 MiB mmap
#: threshold: 4,096 tokens 16.3 s and +410 MiB peak, 2,048 13.4 s +522 MiB, 1,024 12.0-12.5 s +100-350 MiB, 512
#: 12.0-13.6 s +60-170 MiB: past a few rows the matrix products gain nothing, and the activations only cost memory
FORWARD_BATCH_TOKENS = 512


class _PaddedPasses:
    """Forward passes of the decoder over texts in right-padded batches with their attention mask, in inference mode.

    `mask` is the batch in flight's real positions (rows x positions, bool): hooks select them, so a pad never
    enters a statistic and the sums equal one text at a time. Texts go longest first, so a batch's rows are alike in
    length and little is padded; the LM head is not run (the criteria read the layers only).
    """

    def __init__(self, model: nn.Module, tokenizer, texts: Sequence[str], max_length: int) -> None:  # noqa: ANN001
        self.model, self.max_length = model, max_length
        self.seqs = sorted(_encode(tokenizer, texts, max_length), key=len, reverse=True)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.tokens = sum(s.numel() for s in self.seqs)
        self.mask = torch.zeros(0, 0, dtype=torch.bool)

    def run(self, progress: bool, desc: str) -> None:
        device = next(self.model.parameters()).device
        decoder = getattr(self.model, getattr(self.model, "base_model_prefix", "model"), self.model)
        rows = max(1, FORWARD_BATCH_TOKENS // self.max_length)
        with torch.inference_mode():
            for start in tqdm(range(0, len(self.seqs), rows), desc=desc, disable=not progress):
                ids, mask = _batch(self.seqs[start:start + rows], self.pad, device)
                self.mask = mask.bool()
                decoder(input_ids=ids, attention_mask=mask)


def per_sequence_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each row over its own (unpadded) tokens (logits in slices, float32)."""
    return chunked_loss.per_sequence_loss(model, ids, mask)


# ---------------------------------------------------------------- reductions

Reducer = Callable[[torch.Tensor], None]


def _unit_reducers(model: nn.Module, units: Sequence[Unit], acc: torch.Tensor,
                   fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> dict[nn.Parameter, list[Reducer]]:
    """For each parameter, closures adding `fn(grad, weight)` summed per unit into `acc[unit_row]`.

    Vectorised per parameter: one reduction along the slot's dim, then `index_add_` by the unit
    that owns each position (the family's slots say which), gives every unit of a layer at once.
    """
    family = family_of(model)
    layers = families.decoder_layers(model, family)
    reducers: dict[nn.Parameter, list[Reducer]] = defaultdict(list)
    by_layer: dict[tuple[str, int], dict[int | None, int]] = defaultdict(dict)
    for row, u in enumerate(units):
        by_layer[(u.kind, u.layer)][u.index] = row

    def add(param: nn.Parameter, rows: torch.Tensor, dim: int | None) -> None:
        rows = rows.to(acc.device)  # accumulate where `acc` lives: no host sync per gradient on a GPU

        def reduce(grad: torch.Tensor) -> None:
            value = fn(grad, param.detach())
            if dim is None:  # a whole block
                acc[rows] += value.sum().to(acc.device, acc.dtype)
                return
            other = tuple(d for d in range(value.dim()) if d != dim)
            per_position = value.sum(dim=other) if other else value
            acc.index_add_(0, rows, per_position.to(acc.device, acc.dtype))
        reducers[param].append(reduce)

    for (kind, i), rows_of in by_layer.items():
        layer = layers[i]
        if kind == "block":
            row = torch.tensor([rows_of[None]])
            for p in layer.parameters():
                add(p, row, None)
            continue
        shape = families.layer_shape(layer, family)
        n = shape.units(kind)
        if len(rows_of) != n:
            raise PipCoreError(f"layer {i} has {n} {kind} units but {len(rows_of)} were given; score all units of a kind")
        rows = torch.tensor([rows_of[j] for j in range(n)])
        for slot in family.slots(kind):
            owner_rows = rows[families.owners(slot, shape, kind)]
            for tensor, dim in families.slot_tensors(layer, slot):
                add(tensor, owner_rows, dim)
    return reducers


class _GradientTrap:
    """Only unit parameters require grad; each gradient is reduced and freed as soon as it lands."""

    def __init__(self, model: nn.Module, reducers: dict[nn.Parameter, list[Reducer]]) -> None:
        self.model, self.reducers = model, reducers
        self.saved = {p: p.requires_grad for p in model.parameters()}
        self.handles: list = []

    def __enter__(self) -> _GradientTrap:
        wanted = set(self.reducers)
        for p in self.model.parameters():
            p.requires_grad_(p in wanted)
            p.grad = None
        for p, fns in self.reducers.items():
            def hook(param: nn.Parameter, fns: list[Reducer] = fns) -> None:
                for fn in fns:
                    fn(param.grad)
                param.grad = None
            self.handles.append(p.register_post_accumulate_grad_hook(hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        for p, flag in self.saved.items():
            p.requires_grad_(flag)
            p.grad = None


# ---------------------------------------------------------------- methods

def _square(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grad.float().pow(2)


#: PIP's forms of the per-unit gradient difference d = grad(L(s)) - grad(L(s~)):
#: "l2" = ||d|| over the unit (the paper's literal PertImport); "first_order" = sum |w * d|,
#: the first-order change of the perturbation sensitivity when the unit is removed;
#: "single_view" = ||grad(L(s))|| (ablation: no perturbation at all).
PIP_FORMS = ("l2", "first_order", "single_view")
#: PIP as the first-order effect of removing a block on the loss gap between the views (blocks only; see
#: `_removal_sums`); "removal_single_view" is its no-perturbation ablation (the clean view's term alone)
REMOVAL_FORMS = ("removal", "removal_single_view")


def _abs_product(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (grad.float() * weight.float()).abs()


def pert_import(model: nn.Module, tokenizer, pairs: Sequence[tuple[str, str]], units: Sequence[Unit],  # noqa: ANN001
                max_length: int = 128, progress: bool = True, form: str = "l2") -> torch.Tensor:
    """PIP: mean over pairs of each unit's gradient difference between the views, in `form`."""
    total, count = _pert_sums(model, tokenizer, pairs, units, max_length, progress, form)
    return total / count


def _pert_sums(model: nn.Module, tokenizer, pairs: Sequence[tuple[str, str]], units: Sequence[Unit],  # noqa: ANN001
               max_length: int = 128, progress: bool = True, form: str = "l2") -> tuple[torch.Tensor, int]:
    """`pert_import`'s per-unit sum over the pairs (float64) and the number of pairs."""
    if form not in PIP_FORMS:
        raise PipCoreError(f"unknown PIP form {form!r}; use one of {', '.join(PIP_FORMS)}")
    if not pairs:
        raise CalibrationError("empty calibration set: no (original, perturbed) pairs")
    originals = _encode(tokenizer, [p[0] for p in pairs], max_length)
    perturbed = _encode(tokenizer, [p[1] for p in pairs], max_length)
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    total = torch.zeros(len(units), dtype=torch.float64, device=device)
    acc = torch.zeros(len(units), dtype=torch.float64, device=device)
    reducers = _unit_reducers(model, units, acc, _abs_product if form == "first_order" else _square)
    with _GradientTrap(model, reducers):
        for a, b in tqdm(list(zip(originals, perturbed, strict=False)), desc="PIP dual-view gradients",
                         disable=not progress):
            acc.zero_()
            ids, mask = _batch([a, b], pad, device)
            losses = per_sequence_loss(model, ids, mask)
            (losses[0] if form == "single_view" else losses[0] - losses[1]).backward()
            total += acc if form == "first_order" else acc.sqrt()
    return total.cpu(), len(pairs)


def taylor(model: nn.Module, tokenizer, texts: Sequence[str], units: Sequence[Unit],  # noqa: ANN001
           max_length: int = 128, progress: bool = True) -> torch.Tensor:
    """First-order Taylor (LLM-Pruner, element-wise): sum over the unit of |w * dL/dw|.

    The gradient is that of the LM loss summed over the calibration texts, as LLM-Pruner
    accumulates it before taking the product with the weights.
    """
    seqs = _encode(tokenizer, texts, max_length)
    device = next(model.parameters()).device
    params = {p for u in units for p in _unit_params(model, u)}
    saved = {p: p.requires_grad for p in model.parameters()}
    try:
        for p in model.parameters():
            p.requires_grad_(p in params)
            p.grad = None
        for s in tqdm(seqs, desc="Taylor gradients", disable=not progress):
            ids, mask = _batch([s], 0, device)
            per_sequence_loss(model, ids, mask).sum().backward()
        acc = torch.zeros(len(units), dtype=torch.float64)
        reducers = _unit_reducers(model, units, acc, lambda g, w: (g.float() * w.float()).abs())
        for p, fns in reducers.items():
            for fn in fns:
                fn(p.grad if p.grad is not None else torch.zeros_like(p))
        return acc
    finally:
        for p, flag in saved.items():
            p.requires_grad_(flag)
            p.grad = None


def _unit_params(model: nn.Module, unit: Unit) -> list[torch.Tensor]:
    return unit_tensors(model, unit)


@torch.no_grad()
def magnitude(model: nn.Module, units: Sequence[Unit]) -> torch.Tensor:
    """L2 norm of each unit's weights (the group magnitude criterion of Torch-Pruning)."""
    acc = torch.zeros(len(units), dtype=torch.float64)
    for p, fns in _unit_reducers(model, units, acc, lambda g, w: w.float().pow(2)).items():
        for fn in fns:
            fn(p.detach())
    return acc.sqrt()


def block_influence(model: nn.Module, tokenizer, texts: Sequence[str], units: Sequence[Unit],  # noqa: ANN001
                    max_length: int = 128, progress: bool = True) -> torch.Tensor:
    """ShortGPT: mean over tokens of 1 - cos(h_in, h_out) of each block (low = redundant)."""
    total, count = _influence_sums(model, tokenizer, texts, units, max_length, progress)
    return total / count


def _influence_sums(model: nn.Module, tokenizer, texts: Sequence[str], units: Sequence[Unit],  # noqa: ANN001
                    max_length: int = 128, progress: bool = True) -> tuple[torch.Tensor, int]:
    """`block_influence`'s per-unit sum over tokens and the number of tokens."""
    if any(u.kind != "block" for u in units):
        raise PipCoreError("block_influence scores whole blocks only; use unit kind 'block'")
    passes = _PaddedPasses(model, tokenizer, texts, max_length)
    layers = decoder_layers(model)
    sums: dict[int, torch.Tensor] = {}  # on each layer's device: no host sync per batch

    def make_hook(i: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            h_in = args[0] if args else kwargs["hidden_states"]
            h_out = output[0] if isinstance(output, tuple) else output
            real = passes.mask.to(h_in.device)
            cos = nn.functional.cosine_similarity(h_in[real].float(), h_out[real].float(), dim=-1)
            sums[i] = sums.get(i, 0) + (1 - cos).double().sum()
        return hook

    handles = [layer.register_forward_hook(make_hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        passes.run(progress, "block influence")
    finally:
        for h in handles:
            h.remove()
    total = torch.tensor([float(sums[u.layer]) for u in units], dtype=torch.float64)
    return total, passes.tokens


def _removal_sums(model: nn.Module, tokenizer, pairs: Sequence[tuple[str, str]], units: Sequence[Unit],  # noqa: ANN001
                  max_length: int = 128, progress: bool = True, form: str = "removal") -> tuple[torch.Tensor, int]:
    """PIP at the block level: the first-order change of the loss gap L(s) - L(s~) when a block is removed.

    Removing block l replaces its output h_out by its input h_in, so to first order a view's loss moves
    by -<dL/dh_out, h_out - h_in> (summed over the view's tokens). The score is the mean over pairs of
    | <dL(s)/dh_out(s), f(s)> - <dL(s~)/dh_out(s~), f(s~)> |, f = h_out - h_in: the two views' gradients
    differenced along the direction the removal moves each one, where PertImport differences them over
    the unit's weights. One forward of both views and one backward per pair, with respect to the hidden
    states only (no weight gradient is formed). "removal_single_view": mean of |<dL(s)/dh_out, f(s)>|, the
    first-order effect of the removal on the clean view's loss alone (block Taylor, no perturbation).
    """
    originals, perturbed = _block_form_views(form, REMOVAL_FORMS, "removal", units, pairs, tokenizer, max_length)
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    layers = decoder_layers(model)
    branch: dict[int, torch.Tensor] = {}
    grads: dict[int, torch.Tensor] = {}

    def make_hook(i: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            h_in = args[0] if args else kwargs["hidden_states"]
            h_out = output[0] if isinstance(output, tuple) else output
            branch[i] = (h_out - h_in).detach()
            h_out.register_hook(lambda g: grads.__setitem__(i, g.detach()))
        return hook

    def leaf(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.detach().requires_grad_(True)  # activations need gradients, weights do not

    saved = {p: p.requires_grad for p in model.parameters()}
    total = torch.zeros(len(layers), dtype=torch.float64)
    handles = [layer.register_forward_hook(make_hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles.append(model.get_input_embeddings().register_forward_hook(leaf))
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for a, b in tqdm(list(zip(originals, perturbed, strict=False)), desc="PIP removal", disable=not progress):
            branch.clear()
            grads.clear()
            ids, mask = _batch([a, b], pad, device)
            per_sequence_loss(model, ids, mask).sum().backward()  # rows are independent: row v gets dL_v/dh[v]
            for i in range(len(layers)):
                t = (grads[i].double() * branch[i].double() * mask[..., None]).sum(dim=(1, 2))
                total[i] += float((t[0] if form == "removal_single_view" else t[0] - t[1]).abs())
    finally:
        for h in handles:
            h.remove()
        for p, flag in saved.items():
            p.requires_grad_(flag)
    return torch.stack([total[u.layer] for u in units]), len(pairs)


def _activation_sums(model: nn.Module, tokenizer, texts: Sequence[str], units: Sequence[Unit],  # noqa: ANN001
                     max_length: int, progress: bool, method: str) -> tuple[torch.Tensor, int]:
    """Forward-only width criteria read at the input of the module that consumes a unit's output (o_proj for a KV
    group's heads, down_proj for an MLP channel; the family's slot on dim 1). "minitron" (Minitron, arXiv
    2407.14679): the per-token L2 norm of the unit's activations, summed over tokens (divide by the count).
    "wanda_sp" (structured Wanda, as FLAP's baseline): per input channel ||X_j||_2 over all tokens times the
    consumer's column sum_i |W_ij|, summed over the unit's channels (count 1: a whole-set statistic). Pad positions
    of the padded batches are left out of both (`_PaddedPasses.mask`)."""
    if any(u.kind == "block" for u in units):
        raise PipCoreError(f"{method} scores attention groups and MLP channels only; use unit kind width, attn or mlp")
    family = family_of(model)
    layers = families.decoder_layers(model, family)
    rows: dict[tuple[str, int], dict[int, int]] = defaultdict(dict)
    for row, u in enumerate(units):
        rows[(u.kind, u.layer)][u.index] = row
    passes = _PaddedPasses(model, tokenizer, texts, max_length)
    total = torch.zeros(len(units), dtype=torch.float64)
    #: per consumer, on its device (no host sync per batch): wanda_sp the squares per input channel, minitron the
    #: per-unit sums of token norms
    sums: dict[tuple[str, int], torch.Tensor] = {}
    consumers: dict[tuple[str, int], tuple[nn.Module, torch.Tensor, torch.Tensor]] = {}
    handles = []
    for (kind, i), of_layer in rows.items():
        slot = next(s for s in family.slots(kind) if s.dim == 1)
        shape = families.layer_shape(layers[i], family)
        if len(of_layer) != shape.units(kind):
            raise PipCoreError(f"layer {i} has {shape.units(kind)} {kind} units but {len(of_layer)} were given; "
                               "score all units of a kind")
        owner = families.owners(slot, shape, kind)
        unit_rows = torch.tensor([of_layer[j] for j in range(shape.units(kind))])
        consumers[(kind, i)] = (families.get_module(layers[i], slot.module), owner, unit_rows)

        def hook(module: nn.Module, args: tuple, key: tuple[str, int] = (kind, i), owner: torch.Tensor = owner,
                 n_units: int = len(unit_rows)) -> None:
            x = args[0][passes.mask.to(args[0].device)].double()  # real positions only: (tokens, channels)
            if method == "wanda_sp":
                sums[key] = sums.get(key, 0) + x.pow(2).sum(0)
                return
            per_unit = x.new_zeros(x.shape[0], n_units).index_add_(1, owner.to(x.device), x.pow(2))
            sums[key] = sums.get(key, 0) + per_unit.sqrt().sum(0)
        handles.append(consumers[(kind, i)][0].register_forward_pre_hook(hook))
    try:
        passes.run(progress, f"{method} activations")
    finally:
        for h in handles:
            h.remove()
    for key, value in sums.items():
        module, owner, unit_rows = consumers[key]
        if method == "wanda_sp":
            weight = module.weight.detach().double().abs().sum(0)
            total.index_add_(0, unit_rows[owner], (value.sqrt() * weight.to(value.device)).cpu())
        else:
            total.index_add_(0, unit_rows, value.cpu())
    return (total, 1) if method == "wanda_sp" else (total, passes.tokens)


def random_scores(units: Sequence[Unit], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(len(units), generator=generator, dtype=torch.float64)


@dataclass(frozen=True)
class CalibrationData:
    """What the data-reading methods run the model on: its tokenizer, the (original, perturbed) pairs PIP's
    dual-view forms compare, and the plain texts every other method reads (default: the pairs' originals)."""

    tokenizer: Any = None
    pairs: Sequence[tuple[str, str]] | None = ()
    texts: Sequence[str] | None = None

    @property
    def pair_list(self) -> list[tuple[str, str]]:
        return list(self.pairs or [])

    @property
    def text_list(self) -> list[str]:
        return list(self.texts) if self.texts is not None else [p[0] for p in self.pair_list]


#: methods whose score is a sum over calibration examples divided by their count: partial sums over shards of the
#: calibration set add up to the whole set's sums, so these score data-parallel (`score_sums` per shard, then
#: `reduce_sums`). Taylor is not among them (|w * g| of the summed gradient is no sum of per-shard terms);
#: random and magnitude read no data.
SHARDABLE_METHODS = frozenset(m for m in METHODS if m.startswith("pip")) | {"block_influence", "minitron"}
#: forward-only width criteria of the consumer's input activations (`_activation_sums`)
ACTIVATION_METHODS = WIDTH_ONLY_METHODS


def score(model: nn.Module, method: str, units: Sequence[Unit], data: CalibrationData = CalibrationData(), *,
          seed: int = 0, max_length: int = 128, progress: bool = True,
          gradient_checkpointing: bool = False) -> torch.Tensor:
    """Importance of each unit (float64, aligned with `units`; higher = keep), on `data` (magnitude and random
    need none).

    `gradient_checkpointing` recomputes each layer's activations during backward instead of
    storing them: same scores, activation memory of one layer instead of all (for large models).
    """
    with _scoring_mode(model, method, units, seed, gradient_checkpointing):
        if method == "random":
            return random_scores(units, seed)
        if method == "magnitude":
            return magnitude(model, units)
        if data.tokenizer is None:
            raise PipCoreError(f"method {method!r} needs a tokenizer")
        if method == "taylor":
            return taylor(model, data.tokenizer, data.text_list, units, max_length, progress)
        total, count = _sums(model, data, method, units, max_length, progress)
        return total / count


def score_sums(model: nn.Module, method: str, units: Sequence[Unit], data: CalibrationData, *, seed: int = 0,
               max_length: int = 128, progress: bool = True,
               gradient_checkpointing: bool = False) -> tuple[torch.Tensor, int]:
    """One shard's share of `score`: the per-unit sums (float64) and how many examples (pairs, or tokens for
    block influence) they sum over. `reduce_sums` of the shards' results is `score` of the whole set."""
    if method not in SHARDABLE_METHODS:
        raise PipCoreError(f"method {method!r} does not split over calibration shards; use one of "
                           f"{', '.join(sorted(SHARDABLE_METHODS))}, or score in one process")
    with _scoring_mode(model, method, units, seed, gradient_checkpointing):
        return _sums(model, data, method, units, max_length, progress)


def reduce_sums(partials: Sequence[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The scores of the whole calibration set from its shards' (sums, count): sum of sums / sum of counts."""
    if not partials:
        raise PipCoreError("no shard results to reduce")
    total = torch.zeros_like(partials[0][0], dtype=torch.float64)
    for sums, _ in partials:
        if sums.shape != total.shape:
            raise PipCoreError(f"shards scored different units: {tuple(sums.shape)} vs {tuple(total.shape)}")
        total += sums.double()
    return total / sum(count for _, count in partials)


def _sums(model: nn.Module, data: CalibrationData, method: str, units: Sequence[Unit], max_length: int,
          progress: bool) -> tuple[torch.Tensor, int]:
    tokenizer = data.tokenizer
    # the single-view ablations never read the perturbed view: they score the plain texts, each its own partner
    pairs = data.pair_list if method in PERTURBATION_METHODS else [(t, t) for t in data.text_list]
    if method == "block_influence":
        return _influence_sums(model, tokenizer, data.text_list, units, max_length, progress)
    if method in ACTIVATION_METHODS:
        return _activation_sums(model, tokenizer, data.text_list, units, max_length, progress, method)
    kinds = {u.kind for u in units}
    form = (default_form("block" if kinds == {"block"} else "width") if method == "pip"
            else method.removeprefix("pip_"))
    if form in REMOVAL_FORMS:
        return _removal_sums(model, tokenizer, pairs, units, max_length, progress, form)
    return _pert_sums(model, tokenizer, pairs, units, max_length, progress, form)


@contextmanager
def _scoring_mode(model: nn.Module, method: str, units: Sequence[Unit], seed: int,
                  gradient_checkpointing: bool) -> Iterator[None]:
    """Checks, eval mode (or checkpointing's dropout-free train mode) and the seed, restored afterwards.

    The forward-only criteria never checkpoint: with no backward it saves nothing and costs train mode."""
    if method not in METHODS:
        raise PipCoreError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    check_supported(model)
    if not units:
        raise PipCoreError("no units to score")
    was_training = model.training
    model.eval()
    torch.manual_seed(seed)
    try:
        with activation_checkpointing(model, gradient_checkpointing and method not in FORWARD_ONLY_METHODS):
            yield
    finally:
        model.train(was_training)
