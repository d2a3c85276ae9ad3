"""Models of a supported family whose layers have their own widths (KV groups, MLP channels).

One config class and one model class per family row, made by the same two factories: each is
the stock class plus `layer_widths`, and the model resizes each layer's slots after the stock
constructor (`families.resize`, the same slot walk pruning uses). This file (and `families.py`,
which it imports) is copied next to the weights of every per-layer-pruned model (`auto_map`),
so both import only torch and transformers. pipprune registers these classes in-process and
never needs `trust_remote_code`; other tools load them with `trust_remote_code=True`.
"""

from __future__ import annotations

import transformers
from huggingface_hub.dataclasses import strict

from .families import FAMILIES, PRUNED_PREFIX, Family, decoder_layers, resize


def _check_widths(config) -> None:  # noqa: ANN001
    widths = config.layer_widths
    if widths is None:
        return
    if len(widths) != config.num_hidden_layers:
        raise ValueError(f"layer_widths lists {len(widths)} layers, num_hidden_layers is {config.num_hidden_layers}")
    for i, w in enumerate(widths):
        heads, kv = int(w["num_attention_heads"]), int(w["num_key_value_heads"])
        if kv < 1 or heads % kv or heads // kv != config.num_attention_heads // config.num_key_value_heads:
            raise ValueError(f"layer {i}: {heads} heads / {kv} KV heads break the model's GQA ratio")
        if int(w["intermediate_size"]) < 1:
            raise ValueError(f"layer {i}: intermediate_size must be >= 1")


def _config_class(family: Family) -> type:
    base = getattr(transformers, family.config_class)

    class Config(base):
        model_type = PRUNED_PREFIX + family.model_type
        layer_widths: list | None = None

        def validate_architecture(self) -> None:
            _check_widths(self)

    return _name(strict(Config), "Pippruned" + family.config_class)


def _model_class(family: Family, config_cls: type) -> type:
    base = getattr(transformers, family.model_class)

    class Model(base):
        config_class = config_cls

        def __init__(self, config) -> None:  # noqa: ANN001
            super().__init__(config)
            if config.layer_widths is not None:
                for layer, w in zip(decoder_layers(self, family), config.layer_widths, strict=True):
                    resize(layer, family, int(w["num_key_value_heads"]), int(w["intermediate_size"]))

    return _name(Model, "Pippruned" + family.model_class)


def _name(cls: type, name: str) -> type:
    cls.__name__ = cls.__qualname__ = name
    cls.__module__ = __name__
    globals()[name] = cls
    return cls


#: base model_type -> (config class, model class) for per-layer widths
PRUNED_CLASSES: dict[str, tuple[type, type]] = {}
for _family in FAMILIES.values():
    _cfg = _config_class(_family)
    PRUNED_CLASSES[_family.model_type] = (_cfg, _model_class(_family, _cfg))
