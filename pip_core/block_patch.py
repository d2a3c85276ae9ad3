"""A linear patch for removed blocks, folded into the block before each gap (ReplaceMe 2505.02819, LinearPatch
2505.24680): the closed-form repair of block pruning, before any training (issue 48).

Removing blocks a+1..b-1 hands block a's output straight to block b, where the dense model handed it the output of
block b-1. Block a's output is h + m (h: its input plus its attention's contribution, m: its MLP's output), so a
matrix T with h + T m close to the dense output of block b-1 stands in for the whole gap; T m = (T W_down) x, so it
is folded into block a's down_proj and the model keeps its stock shape. T is the ridge least-squares fit of the
dense gap's output less h, against m, on the calibration texts: m and h from the pruned model (each block runs on
the states the patched blocks before it give), the target from the dense model, streamed through float64 Gram
matrices (`repair.GramStats`), as the width repair fits its consumers.

Which dense block each kept block is, is read from the weights (a block keeps its attention weights unchanged), so
no index travels from the prune step. A gap before the first kept block has no block to fold into and is left as
it is; families whose MLP output passes a norm before the residual add (`Family.mlp_output_norm`) are refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from pip_core import families
from pip_core.families import Family
from pip_core.repair import (
    ConsumerRepair,
    GramStats,
    RepairError,
    RepairOptions,
    RepairReport,
    _Batch,
    _batches,
    _layer_inputs,
    _run,
    evaluating,
)
from pip_core.units import check_supported

log = logging.getLogger(__name__)


def dense_indices(pruned: nn.Module, dense: nn.Module, family: Family) -> list[int]:
    """For each block of `pruned`, the index of the dense block it is (equal attention weights), increasing."""
    slot = family.attn[0].module

    def key(layer: nn.Module) -> bytes:
        return families.get_module(layer, slot).weight.detach().float().cpu().contiguous().numpy().tobytes()

    where: dict[bytes, list[int]] = {}
    for i, layer in enumerate(families.decoder_layers(dense, family)):
        where.setdefault(key(layer), []).append(i)
    out: list[int] = []
    for j, layer in enumerate(families.decoder_layers(pruned, family)):
        free = [i for i in where.get(key(layer), []) if not out or i > out[-1]]
        if not free:
            raise RepairError(f"block {j} of the pruned model is no block of the dense model (after block "
                              f"{out[-1] if out else 'none'}): not its block-pruned copy")
        out.append(free[0])
    return out


def gaps(indices: Sequence[int], dense_layers: int) -> dict[int, int]:
    """{pruned block j: the last dense block of the gap after it} for every kept block followed by removed ones."""
    nxt = [*indices[1:], dense_layers]
    return {j: b - 1 for j, (a, b) in enumerate(zip(indices, nxt, strict=True)) if b > a + 1}


@torch.no_grad()
def patch_blocks(pruned: nn.Module, dense: nn.Module, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str],
                 options: RepairOptions = RepairOptions()) -> RepairReport:
    """Fold a linear patch for every gap of removed blocks into the down_proj of the block before it, in place."""
    start = time.perf_counter()
    options.check()
    if options.form != "lstsq":
        raise RepairError(f"repair form {options.form!r} repairs width units; removed blocks are patched by 'lstsq'")
    family = check_supported(pruned)
    if check_supported(dense) != family:
        raise RepairError(f"the dense model is a {dense.config.model_type}, the pruned one a {pruned.config.model_type}")
    if family.mlp_output_norm:
        raise RepairError(f"the {family.model_type} family normalises the MLP's output ({family.mlp_output_norm}) "
                          "before the residual add, so a linear patch cannot be folded into down_proj; use repair none")
    d_layers, p_layers = families.decoder_layers(dense, family), families.decoder_layers(pruned, family)
    todo = gaps(dense_indices(pruned, dense, family), len(d_layers))
    batches = _batches(tokenizer, texts, options)
    report = RepairReport(form="lstsq", tokens=sum(int(b.mask.sum()) for b in batches))
    if not todo:
        return report
    with evaluating(pruned, dense):
        targets = _dense_outputs(dense, family, batches, set(todo.values()))
        states, calls = _layer_inputs(pruned, family, batches)
        for j in tqdm(range(max(todo) + 1), desc="block patch", disable=not options.progress):
            layer_calls = [c[j] for c in calls]
            if j in todo:
                report.consumers.append(_patch(j, p_layers[j], family, states, layer_calls, batches,
                                               targets.pop(todo[j]), options))
            states = [_run(p_layers[j], h, call) for h, call in zip(states, layer_calls, strict=True)]
    report.seconds = time.perf_counter() - start
    return report


def _dense_outputs(dense: nn.Module, family: Family, batches: Sequence[_Batch], wanted: set[int]
                   ) -> dict[int, list[torch.Tensor]]:
    """The dense model's output states of each block in `wanted`, per batch, at the real positions."""
    states, calls = _layer_inputs(dense, family, batches)
    out: dict[int, list[torch.Tensor]] = {}
    for i, layer in enumerate(families.decoder_layers(dense, family)[:max(wanted) + 1]):
        states = [_run(layer, h, c[i]) for h, c in zip(states, calls, strict=True)]
        if i in wanted:
            out[i] = [h[b.mask.to(h.device)] for h, b in zip(states, batches, strict=True)]
    return out


def _patch(j: int, layer: nn.Module, family: Family, states: list[torch.Tensor], calls: list, batches: Sequence[_Batch],
           targets: list[torch.Tensor], options: RepairOptions) -> ConsumerRepair:
    """Fit T on (MLP output, dense gap output less the rest of block j's output) and fold it into down_proj."""
    mlp = families.get_module(layer, family.mlp_module)
    down = next(families.get_module(layer, s.module) for s in family.mlp if s.dim == 1)
    hidden = down.weight.shape[0]
    stats = GramStats(hidden, hidden, down.weight.device)
    seen: list[torch.Tensor] = []
    handle = mlp.register_forward_hook(lambda module, args, output: seen.append(output))
    try:
        for h, call, batch, target in zip(states, calls, batches, targets, strict=True):
            seen.clear()
            out = _run(layer, h, call)
            real = batch.mask.to(out.device)
            m = seen[0][real]
            stats.add(m, target.to(out.device) - (out[real] - m), relative=options.relative)
    finally:
        handle.remove()
    identity = torch.eye(hidden, dtype=torch.float64)
    before = stats.error(identity, None)
    t, bias = stats.solve(options.ridge, with_bias=down.bias is not None, prior=identity)  # towards no patch
    after = stats.error(t, bias)
    t = t.to(down.weight.device, torch.float64)
    new_weight = t @ down.weight.double()
    if down.bias is not None:
        down.bias.copy_((t @ down.bias.double() + bias.to(t.device)).to(down.bias.dtype))
    down.weight.copy_(new_weight.to(down.weight.dtype))
    log.info("block patch after block %d: gap output error %.4f -> %.4f", j, before, after)
    return ConsumerRepair(layer=j, module=f"{family.mlp_module} (patch)", columns=hidden, dense_columns=hidden,
                          error_before=before, error_after=after)
