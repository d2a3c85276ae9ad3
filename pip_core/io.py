"""Save and load pruned models as ordinary Hugging Face directories (safetensors).

Uniform shapes keep the stock config, so any tool loads them. Per-layer widths use the config +
model classes of `modeling_pipprune`, saved beside the weights with an `auto_map`; pipprune
registers those classes in-process and so never needs `trust_remote_code` for its own output.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import shutil
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from pip_core import families, modeling_pipprune
from pip_core.errors import UnsupportedArchitectureError
from pip_core.prune import sync_config
from pip_core.units import check_supported, param_count
from pip_core.weights_memory import own_weights

log = logging.getLogger(__name__)

__all__ = ["save_pruned", "save_tokenizer", "load", "check_loadable", "check_weights", "check_tokenizer", "model_fingerprint",
           "param_count", "param_count_from_dir"]

#: files that describe a run, not the model (left out of the fingerprint)
_NOT_MODEL_FILES = {"pipprune_provenance.json"}
MODELING_FILE = Path(modeling_pipprune.__file__)
#: the files a tokenizer is kept in (whichever of them its directory has)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


def register_classes() -> None:
    """Make AutoConfig/AutoModelForCausalLM resolve our per-layer types to our own code (idempotent)."""
    for config_cls, model_cls in modeling_pipprune.PRUNED_CLASSES.values():
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)


def _stock_valid(config_dict: dict, family: families.Family, head_dim: int) -> bool:
    """True if the stock config class accepts these widths and rebuilds the same head size."""
    stock_cls = getattr(transformers, family.config_class)
    try:
        stock = stock_cls(**config_dict)
    except (ValueError, TypeError):
        return False
    rebuilt = getattr(stock, "head_dim", None) or stock.hidden_size // stock.num_attention_heads
    return rebuilt == head_dim


def save_pruned(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | Path) -> Path:
    """Write `model` (+ tokenizer) to `out_dir`; the model object is switched to the matching class."""
    family = check_supported(model)
    sync_config(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    fields = {k: v for k, v in config.to_dict().items()
              if k not in {"model_type", "layer_widths", "auto_map", "architectures", "transformers_version"}}
    widths = getattr(config, "layer_widths", None)
    head_dim = int(config.head_dim)
    if widths is None and _stock_valid(fields, family, head_dim):
        new_config = getattr(transformers, family.config_class)(**fields)
        model.__class__ = getattr(transformers, family.model_class)
    else:
        if widths is None:
            log.warning("stock %s refuses these widths; saving with per-layer classes", family.config_class)
        config_cls, model_cls = modeling_pipprune.PRUNED_CLASSES[family.model_type]
        new_config = config_cls(**{**fields, "head_dim": head_dim}, layer_widths=widths)
        model.__class__ = model_cls
        config_cls.register_for_auto_class()
        model_cls.register_for_auto_class("AutoModelForCausalLM")
    new_config.architectures = [model.__class__.__name__]
    model.config = new_config
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        save_tokenizer(tokenizer, out)
    return out


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: str | Path) -> None:
    """Write the tokenizer its source directory holds, byte for byte.

    Why not `save_pretrained`: encoding with `truncation=True, max_length=N` (calibration, evaluation)
    leaves that setting on a fast tokenizer's backend, and `save_pretrained` writes it into
    tokenizer.json, where Rust servers and converters read it and cut every input to N tokens; the
    bytes would also depend on what ran before the save, so two runs making the same step would
    write different files under one content-addressed name. A tokenizer with no source directory
    (built in memory) is saved from a copy with truncation and padding off.
    """
    out = Path(out_dir)
    source = Path(tokenizer.name_or_path) if tokenizer.name_or_path else None
    files = [source / name for name in TOKENIZER_FILES] if source is not None and source.is_dir() else []
    files = [f for f in files if f.is_file()]
    if any(f.name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json") for f in files):
        if source.resolve() != out.resolve():
            for path in files:
                shutil.copyfile(path, out / path.name)
        return
    clean = copy.deepcopy(tokenizer)
    backend = getattr(clean, "backend_tokenizer", None)
    if backend is not None:
        backend.no_truncation()
        backend.no_padding()
    clean.save_pretrained(out)


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    return json.loads(path.read_text())


def check_loadable(model_dir: str | Path) -> dict:
    """Refuse, before loading any weights, a directory that is not a supported causal LM."""
    config = read_config(model_dir)
    model_type = config.get("model_type")
    try:
        families.family_for(model_type)
    except families.UnsupportedFamilyError:
        arch = ", ".join(config.get("architectures") or [str(model_type)])
        raise UnsupportedArchitectureError(
            f"unsupported architecture {arch} (model_type={model_type!r}) in {model_dir}; "
            f"pipprune prunes these families: {families.supported()}") from None
    if not list(Path(model_dir).glob("*.safetensors")):
        raise FileNotFoundError(f"{model_dir} has no .safetensors weights (pickled checkpoints are not loaded)")
    return config


def check_weights(model_dir: str | Path, config: dict) -> None:
    """Refuse, from the safetensors headers alone, weights that do not fit the layout `config` describes.

    Loading would otherwise give missing tensors fresh random values and prune those: a checkpoint
    with renamed or reshaped layer weights is an unknown layer layout, named here.
    """
    from safetensors import safe_open

    from pip_core.memory_plan import meta_model

    expected = {n: tuple(p.shape) for n, p in meta_model(config).named_parameters()}  # tied ones once
    stored: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            stored.update({name: tuple(fh.get_slice(name).get_shape()) for name in fh.keys()})
    missing = sorted(set(expected) - set(stored))
    wrong = sorted(n for n in set(expected) & set(stored) if expected[n] != stored[n])
    if missing or wrong:
        detail = (f"missing {missing[:3]}" if missing else "") + \
            (f"{'; ' if missing else ''}shape of {wrong[0]} is {stored[wrong[0]]}, the config implies "
             f"{expected[wrong[0]]}" if wrong else "")
        raise UnsupportedArchitectureError(
            f"unknown layer layout in {model_dir}: the weights do not match the {config.get('model_type')} layout "
            f"({detail}{', ...' if len(missing) + len(wrong) > 3 else ''})")


def check_tokenizer(model_dir: str | Path) -> None:
    """Refuse a directory without tokenizer files before any work starts."""
    names = {"tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json"}
    if not any((Path(model_dir) / n).is_file() for n in names):
        raise FileNotFoundError(f"{model_dir} has no tokenizer (none of {sorted(names)})")


def load(model_dir: str | Path, dtype: torch.dtype | str = "auto", device_map: str | None = None,
         tokenizer: bool = True, device: str | None = None) -> tuple[nn.Module, PreTrainedTokenizerBase | None]:
    """Load a model directory (stock or per-layer pruned) and its tokenizer, safetensors only.

    `dtype="auto"` keeps the checkpoint's own dtype (a bf16 checkpoint stays bf16, and so does what
    is saved from it). `device` places the whole model on one device; `device_map="auto"` spreads
    it over the visible GPUs with CPU offload instead (needs accelerate).
    """
    config = check_loadable(model_dir)
    register_classes()
    if isinstance(dtype, str):
        from pip_core.placement import resolve_dtype, torch_dtype

        dtype = torch_dtype(resolve_dtype(dtype, config))
    if device is not None and device_map is None and device != "cpu":
        from pip_core.placement import resolve_device

        device_map = resolve_device(device)  # refuses a CUDA device that is not there
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=device_map,
                                                 use_safetensors=True, trust_remote_code=False)
    own_weights(model)  # out of the file's memory map: pruned blocks then give their memory back
    model.eval()
    tok = None
    if tokenizer:
        try:
            tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        except (OSError, ValueError) as exc:
            raise FileNotFoundError(f"no usable tokenizer in {model_dir}: {exc}") from exc
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
    return model, tok


def model_fingerprint(model_dir: str | Path) -> str:
    """sha256 over every file's relative path and sha256 (provenance files excluded)."""
    root = Path(model_dir)
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel in _NOT_MODEL_FILES or rel.startswith(".cache/"):
            continue
        h.update(rel.encode() + b"\0" + _sha256_file(path).encode() + b"\n")
    return h.hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def param_count_from_dir(model_dir: str | Path) -> int:
    """Parameter count from safetensors headers alone (tied weights stored once count once)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():
                shape = fh.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n
    return total
