"""Write a Hugging Face causal-LM directory (stock config: dense, block-pruned or uniform-width) as one GGUF file.

Everything about the file format is the `gguf` package's (llama.cpp's own Python writer): `GGUFWriter`
lays out the file, `get_tensor_name_map` names each tensor for the architecture, `gguf.quants.quantize`
packs the blocks and `SpecialVocab` reads merges and special-token ids from tokenizer.json. What this
module decides is the llama.cpp converter's behaviour, mirrored:

- LLaMA-layout rotary embeddings: llama.cpp rotates adjacent pairs where transformers rotates halves, so
  the q/k projection rows are permuted per head (readers undo it);
- Gemma stores each RMSNorm scale as 1 + w;
- 1-D tensors (norms, biases) stay F32; a matrix whose rows do not split into whole quantization blocks
  is written F16 instead (recorded in `GgufInfo.fallbacks`);
- a tied LM head is not written (readers tie it back to the embedding);
- the tokenizer goes in too (vocabulary, token types, merges, special ids, add-BOS), so the file is
  self-contained.

Refused before any tensor is read (`GgufExportError`, naming why): per-layer-width outputs (GGUF keeps
one width per model), families without a row below, non-default RoPE scaling, tokenizers that are not a
byte-level or byte-fallback BPE in tokenizer.json, and any config field an independent reader
(transformers' GGUF loader) would rebuild differently from the file's metadata (checked by writing the
metadata alone and reading it back, so a pruned shape the format cannot state is caught here, not in
the quality numbers).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from infra.hashing import sha256_file

log = logging.getLogger(__name__)

#: quantization types offered (names as `--quant` takes them), best quality first. The gguf package can
#: also produce TQ1_0/TQ2_0 (ternary: only for models trained ternary) and MXFP4 (llama.cpp uses it for
#: MoE experts only); K-quants and IQ types raise NotImplementedError in its numpy quantizer.
OFFERED_QUANTS = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


class GgufExportError(ValueError):
    """The model cannot be written as GGUF (the message names why and, where there is one, the fix)."""


@dataclass(frozen=True)
class GgufFamily:
    """How one transformers family is written: the GGUF architecture and llama.cpp's converter transforms."""

    model_type: str
    arch: str  # gguf.MODEL_ARCH member name
    #: llama.cpp's LLaMA rope rotates adjacent pairs: q/k rows are permuted per head (transformers' reader undoes it)
    permute_qk: bool = False
    #: Gemma's RMSNorm scales by (1 + w); llama.cpp stores 1 + w
    norm_offset: float = 0.0
    #: llama.cpp runs this architecture's sliding-window layers (the window is written and read back); without it,
    #: a model whose window is active below its context length is refused
    swa: bool = False


#: families whose stock config llama.cpp reads and transformers' GGUF loader reads back (pip_core.families names)
GGUF_FAMILIES: dict[str, GgufFamily] = {f.model_type: f for f in (
    GgufFamily("llama", "LLAMA", permute_qk=True),
    GgufFamily("mistral", "LLAMA", permute_qk=True),  # llama.cpp's converter writes Mistral as llama
    GgufFamily("qwen2", "QWEN2"),
    GgufFamily("qwen3", "QWEN3"),
    GgufFamily("gemma2", "GEMMA2", norm_offset=1.0, swa=True),
    GgufFamily("phi3", "PHI3"),
)}
#: families pipprune prunes that are refused, and why
REFUSED_FAMILIES = {
    "olmo2": "transformers' GGUF loader cannot read olmo2, so the exported file's quality could not be measured "
             "by an independent reader",
    "gemma3_text": "Gemma 3 has two RoPE bases (local and global layers) and transformers' GGUF loader reads one, "
                   "so an independent reader would rebuild a different model",
}
#: config fields that do not change the network's outputs, or that the writer handles itself
_CONFIG_IGNORED = {
    "architectures", "_name_or_path", "name_or_path", "dtype", "torch_dtype", "transformers_version", "model_type",
    "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "tie_word_embeddings", "use_cache",
    "initializer_range", "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward",
    "is_encoder_decoder", "problem_type", "tokenizer_class", "id2label", "label2id", "_attn_implementation_autoset",
    "max_position_embeddings", "attn_implementation", "_attn_implementation", "pretraining_tp", "auto_map",
    "quantization_config",
}
#: window fields compared only for families that write the window (`GgufFamily.swa`); the others check it is off
_WINDOW_FIELDS = {"sliding_window", "use_sliding_window", "max_window_layers"}


@dataclass
class GgufInfo:
    """What `write_gguf` wrote."""

    path: Path
    sha256: str
    quant: str  # as asked: "q8_0"
    file_type: str  # gguf.LlamaFileType name: "MOSTLY_Q8_0"
    arch: str  # general.architecture: "llama"
    size_bytes: int
    n_tensors: int
    #: tensors per ggml type: {"Q8_0": 37, "F32": 13}
    tensor_types: dict[str, int]
    #: tensors written F16 because their rows do not split into whole blocks of the asked type
    fallbacks: list[str] = field(default_factory=list)
    n_vocab: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "sha256": self.sha256, "quant": self.quant, "file_type": self.file_type,
                "arch": self.arch, "size_bytes": self.size_bytes, "n_tensors": self.n_tensors,
                "tensor_types": dict(self.tensor_types), "fallbacks": list(self.fallbacks), "n_vocab": self.n_vocab}


# ------------------------------------------------------------------------------------------ quant types
@functools.cache
def producible_quants() -> tuple[str, ...]:
    """The offered types this install's `gguf` package can actually quantize to (probed once)."""
    import gguf
    from gguf.quants import quantize

    out = []
    probe = np.linspace(-1, 1, 2 * 256, dtype=np.float32).reshape(2, 256)
    for name in OFFERED_QUANTS:
        try:
            quantize(probe, gguf.GGMLQuantizationType[name.upper()])
        except (NotImplementedError, KeyError):
            continue
        out.append(name)
    return tuple(out)


def check_quant(quant: str) -> str:
    """The normalised quant name, or GgufExportError listing what can be produced."""
    name = quant.strip().lower()
    if name not in producible_quants():
        raise GgufExportError(f"quantization type {quant!r} is not one the gguf package can produce here; choose one of "
                              f"{', '.join(producible_quants())}")
    return name


def _file_type(quant: str):  # gguf.LlamaFileType
    import gguf

    return gguf.LlamaFileType.ALL_F32 if quant == "f32" else gguf.LlamaFileType[f"MOSTLY_{quant.upper()}"]


# -------------------------------------------------------------------------------------- pre-flight checks
def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise GgufExportError(f"{path} not found: a GGUF export needs the model's {path.name}") from None
    except json.JSONDecodeError as exc:
        raise GgufExportError(f"{path} is not valid JSON: {exc}") from None


def family_of(config: dict) -> GgufFamily:
    """The writer's row for a config.json dict, or GgufExportError naming why it cannot be written."""
    model_type = str(config.get("model_type", ""))
    if model_type.startswith("pipprune_") or config.get("per_layer_config") or config.get("layer_widths"):
        raise GgufExportError(f"model_type {model_type!r} has per-layer widths: GGUF (and llama.cpp) keep one attention "
                              "and MLP width for every layer; export a uniform-width or block-pruned model "
                              "(compress --width-mode uniform)")
    if model_type in REFUSED_FAMILIES:
        raise GgufExportError(f"family {model_type!r} cannot be exported to GGUF: {REFUSED_FAMILIES[model_type]}")
    if model_type not in GGUF_FAMILIES:
        raise GgufExportError(f"family {model_type!r} has no GGUF writer; exportable families: "
                              f"{', '.join(GGUF_FAMILIES)}")
    window = _active_window(config)
    if window is not None and not GGUF_FAMILIES[model_type].swa:
        raise GgufExportError(f"sliding_window={window} is active below the context length "
                              f"({config.get('max_position_embeddings')}) and llama.cpp's "
                              f"{GGUF_FAMILIES[model_type].arch.lower()} architecture has no sliding window: the file "
                              "would attend differently from the model")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in ("default", None):
        raise GgufExportError(f"RoPE scaling {rope_type!r} is not exported: transformers' GGUF loader rebuilds the "
                              "default rotary embedding, so the file could not be checked against the model")
    return GGUF_FAMILIES[model_type]


def _active_window(config: dict) -> int | None:
    """The sliding window the model uses (None: full attention everywhere, or a window no shorter than the context)."""
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window") is False:
        return None
    if int(window) >= int(config.get("max_position_embeddings") or 0):
        return None
    return int(window)


def _head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _rope_theta(config: dict) -> float:
    rope = config.get("rope_parameters") or {}
    return float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)


# ------------------------------------------------------------------------------------------- tokenizer
_QWEN2_SPLIT_HEAD = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
_LLAMA3_SPLIT_HEAD = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"


def _pre_tokenizer_name(pre: dict | None) -> str:
    """llama.cpp's name for a byte-level BPE pre-tokenizer (it picks its split regex by this name)."""
    if not pre:
        raise GgufExportError("tokenizer.json has no pre-tokenizer: llama.cpp could not split text as the model does")
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"  # llama.cpp's name (its loader refuses "gpt2")
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds[:1] == ["Split"] and kinds[-1] == "ByteLevel":
        regex = (steps[0].get("pattern") or {}).get("Regex", "")
        if regex.startswith(_QWEN2_SPLIT_HEAD):
            return "qwen2"
        if regex.startswith(_LLAMA3_SPLIT_HEAD):
            return "llama-bpe"
    raise GgufExportError(f"tokenizer.json pre-tokenizer {kinds} is not one llama.cpp names (gpt-2, smollm, qwen2, "
                          "llama-bpe): the GGUF file would split text differently from the model")


@dataclass
class _Vocab:
    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (byte-fallback BPE / SentencePiece)
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float] | None


def read_vocab(model_dir: Path, n_vocab: int) -> _Vocab:
    """The vocabulary from tokenizer.json, padded to the model's embedding rows as llama.cpp pads it."""
    import gguf

    tok = _read_json(model_dir / "tokenizer.json")
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        raise GgufExportError(f"tokenizer.json model {model.get('type')!r} is not exported: GGUF export reads BPE "
                              "tokenizers (byte-level, as GPT-2/SmolLM2/Qwen2/Llama 3, or byte-fallback, as Llama 2)")
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {a["content"]: a for a in tok.get("added_tokens") or []}
    for content, entry in added.items():
        vocab.setdefault(content, int(entry["id"]))
    byte_fallback = bool(model.get("byte_fallback"))
    if len(vocab) > n_vocab:
        raise GgufExportError(f"tokenizer.json has {len(vocab)} tokens but the model embeds only {n_vocab}")
    by_id: dict[int, str] = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(n_vocab):
        text = by_id.get(i)
        if text is None:  # embedding rows no token uses: llama.cpp's converter names them [PAD<i>]
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif text in added:
            tokens.append(text)
            types.append(gguf.TokenType.CONTROL if added[text].get("special") else gguf.TokenType.USER_DEFINED)
        elif byte_fallback and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):
            tokens.append(text)
            types.append(gguf.TokenType.BYTE)
        else:
            tokens.append(text)
            types.append(gguf.TokenType.NORMAL)
    if byte_fallback:  # SentencePiece-style BPE: llama.cpp ranks merges by score
        scores = [-float(i) if t == gguf.TokenType.NORMAL else -1000.0 for i, t in enumerate(types)]
        return _Vocab("llama", None, tokens, [int(t) for t in types], scores)
    pre = tok.get("pre_tokenizer") or {}
    if "ByteLevel" not in json.dumps(pre) and (tok.get("decoder") or {}).get("type") != "ByteLevel":
        raise GgufExportError("tokenizer.json is a BPE that is neither byte-level nor byte-fallback: not a "
                              "tokenizer llama.cpp reads")
    return _Vocab("gpt2", _pre_tokenizer_name(tok.get("pre_tokenizer")), tokens, [int(t) for t in types], None)


def _add_vocab(writer, model_dir: Path, vocab: _Vocab) -> None:  # noqa: ANN001 - gguf.GGUFWriter
    import gguf

    writer.add_tokenizer_model(vocab.model)
    if vocab.pre:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
        writer.add_add_space_prefix(False)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(vocab.tokens))
    special.add_to_gguf(writer, quiet=True)


# ------------------------------------------------------------------------------------------ metadata
def _add_hparams(writer, config: dict, fam: GgufFamily, n_vocab: int, quant: str, name: str) -> None:  # noqa: ANN001
    import gguf

    head_dim = _head_dim(config)
    # transformers' loader reads a llama file named exactly "mistral" as Mistral, which it then cannot map
    writer.add_name(name if name != "mistral" else "mistral-model")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_context_length(int(config.get("max_position_embeddings") or 2048))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or config["num_attention_heads"]))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * float(config.get("partial_rotary_factor") or 1.0)))
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps") or 1e-6))
    writer.add_vocab_size(n_vocab)
    if config.get("sliding_window") and fam.model_type.startswith("gemma"):
        writer.add_sliding_window(int(config["sliding_window"]))
    for key, add in (("attn_logit_softcapping", writer.add_attn_logit_softcapping),
                     ("final_logit_softcapping", writer.add_final_logit_softcapping)):
        if config.get(key) is not None:
            add(float(config[key]))
    writer.add_file_type(_file_type(quant))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_metadata_only(path: Path, config: dict, fam: GgufFamily, vocab: _Vocab, model_dir: Path, quant: str,
                         name: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[fam.arch]])
    _add_hparams(writer, config, fam, len(vocab.tokens), quant, name)
    _add_vocab(writer, model_dir, vocab)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-12)
        except (TypeError, ValueError):
            return False
    if isinstance(a, dict) and isinstance(b, dict):
        return all(_same(a.get(k), b.get(k)) for k in set(a) | set(b))
    return a == b


def check_readback_config(model_dir: Path, config: dict, fam: GgufFamily, vocab: _Vocab, quant: str,
                          name: str) -> None:
    """Write the metadata alone, let transformers' GGUF loader rebuild the config, refuse on any difference.

    The comparison is between the two config objects of the family's own class (class defaults filled in on
    both sides), over every field that changes the network's outputs.
    """
    import transformers
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory(prefix="pipprune-gguf-meta-") as tmp:
        _write_metadata_only(Path(tmp) / "meta.gguf", config, fam, vocab, model_dir, quant, name)
        try:
            back = AutoConfig.from_pretrained(tmp, gguf_file="meta.gguf").to_dict()
        except (ValueError, KeyError, OSError) as exc:
            raise GgufExportError(f"transformers' GGUF loader cannot read a {fam.model_type} file's metadata: {exc}") \
                from None
    source = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "transformers_version"}).to_dict()
    back_cls = getattr(transformers, type(AutoConfig.for_model(fam.model_type)).__name__)
    back = back_cls(**{k: v for k, v in back.items() if k not in ("model_type", "transformers_version")}).to_dict()
    for side in (source, back):  # a config that leaves head_dim unset means hidden_size / heads
        side["head_dim"] = _head_dim(side)
    ignored = _CONFIG_IGNORED | (set() if fam.swa else _WINDOW_FIELDS)
    differ = [f"{k}: model {source.get(k)!r}, as read back {back.get(k)!r}"
              for k in sorted(source)  # the source class's fields (Mistral reads back as Llama, with more)
              if k not in ignored and not k.startswith("_") and not _same(source.get(k), back.get(k))]
    if differ:
        raise GgufExportError(f"the GGUF metadata of this {fam.model_type} model does not state every field an "
                              f"independent reader needs (transformers' GGUF loader rebuilds a different model): "
                              + "; ".join(differ))


def check_exportable(model_dir: Path, quant: str = "f16", weights: bool = True) -> tuple[dict, GgufFamily, _Vocab]:
    """Everything `write_gguf` refuses, checked before any tensor is read; returns (config, family, vocab).

    Needs config.json and the tokenizer files only; `weights=False` skips looking for the safetensors (a caller
    that checks a checkpoint from its small files before fetching the weights).
    """
    model_dir = Path(model_dir)
    quant = check_quant(quant)
    config = _read_json(model_dir / "config.json")
    fam = family_of(config)
    if weights and not any(model_dir.glob("*.safetensors")):
        raise GgufExportError(f"{model_dir} has no *.safetensors weights (GGUF export reads safetensors)")
    n_vocab = int(config["vocab_size"])
    vocab = read_vocab(model_dir, n_vocab)
    check_readback_config(model_dir, config, fam, vocab, quant, model_dir.name)
    return config, fam, vocab


# ------------------------------------------------------------------------------------------- tensors
def _permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Per head, reorder rows from transformers' (first half, second half) rotary layout to llama.cpp's pairs."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _iter_weights(model_dir: Path):  # Iterator[tuple[str, np.ndarray]]
    """(name, float32 array) for every tensor of the safetensors files, in file and key order."""
    from safetensors import safe_open

    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():  # safe_open is not a mapping
                yield key, fh.get_tensor(key).float().numpy()


def _ggml_type(quant: str, array: np.ndarray, gguf_name: str):  # (GGMLQuantizationType, bool)
    """The type a tensor is stored as, and whether that is a fallback from the asked type."""
    import gguf

    if array.ndim < 2 or gguf_name.endswith(".bias") or "norm" in gguf_name:
        return gguf.GGMLQuantizationType.F32, False
    qtype = gguf.GGMLQuantizationType[quant.upper()]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if array.shape[-1] % block:
        return gguf.GGMLQuantizationType.F16, True
    return qtype, False


def write_gguf(model_dir: Path, out: Path, quant: str = "f16", name: str | None = None) -> GgufInfo:
    """Write the model directory `model_dir` to the GGUF file `out` (atomically) with weights in `quant`.

    Refusals (`GgufExportError`) come before any tensor is read. The file's bytes depend only on the
    directory's contents and `quant`, so its sha256 is a content address.
    """
    import gguf
    from gguf.quants import quantize

    model_dir, out = Path(model_dir), Path(out)
    quant = check_quant(quant)
    config, fam, vocab = check_exportable(model_dir, quant)
    arch = gguf.MODEL_ARCH[fam.arch]
    n_layers = int(config["num_hidden_layers"])
    names = gguf.get_tensor_name_map(arch, n_layers)
    n_heads, n_kv = int(config["num_attention_heads"]), int(config.get("num_key_value_heads") or
                                                             config["num_attention_heads"])
    tied = bool(config.get("tie_word_embeddings", False))
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    counts: Counter[str] = Counter()
    fallbacks: list[str] = []
    try:
        writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[arch])
        _add_hparams(writer, config, fam, len(vocab.tokens), quant, name or model_dir.name)
        _add_vocab(writer, model_dir, vocab)
        for key, array in _iter_weights(model_dir):
            if tied and key == "lm_head.weight":
                continue
            gguf_name = names.get_name(key, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise GgufExportError(f"tensor {key!r} has no {fam.arch.lower()} GGUF name: not a stock "
                                      f"{fam.model_type} layout")
            if fam.permute_qk and key.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                array = _permute_rope_rows(array, n_heads)
            elif fam.permute_qk and key.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
                array = _permute_rope_rows(array, n_kv)
            if fam.norm_offset and key.endswith("norm.weight"):
                array = array + fam.norm_offset
            qtype, fell_back = _ggml_type(quant, array, gguf_name)
            if fell_back:
                fallbacks.append(gguf_name)
            data = quantize(np.ascontiguousarray(array), qtype)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
            counts[qtype.name] += 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fallbacks:
        log.warning("%d tensor(s) written F16: rows not a multiple of the %s block: %s", len(fallbacks), quant,
                    ", ".join(fallbacks))
    return GgufInfo(path=out, sha256=sha256_file(out), quant=quant, file_type=_file_type(quant).name,
                    arch=gguf.MODEL_ARCH_NAMES[arch], size_bytes=out.stat().st_size, n_tensors=sum(counts.values()),
                    tensor_types=dict(sorted(counts.items())), fallbacks=fallbacks, n_vocab=len(vocab.tokens))
