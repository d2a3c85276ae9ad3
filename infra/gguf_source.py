"""A GGUF file as a model input: llama.cpp and Ollama users hold their models this way.

The file is read with transformers' own GGUF support (the `gguf` package underneath), dequantized
once into an ordinary Hugging Face directory under the state dir's cache, and named by the file's
sha256, so a second run with the same file reads that directory instead of dequantizing again.
Every GGUF type dequantizes exactly into float32, so the directory is float32 and the run's
`--dtype` applies when it is loaded, as for any checkpoint. The quantization noise is part of the
model: the dequantized weights are the dense source, and lineage records which file (sha256 and
quantization types) they came from.

Free of Prefect imports: the command line's checks run it before any service starts.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from infra.hashing import sha256_file
from infra.memory import release_free_heap

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
#: beside the dequantized weights: which file they came from (also how a finished directory is recognised)
SOURCE_RECORD = "gguf_source.json"
#: the tokenizer files a dequantized directory keeps (transformers writes them from the GGUF's vocabulary)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class GgufError(ValueError):
    """The GGUF file cannot be read, or holds an architecture transformers or pipprune cannot use."""


@dataclass(frozen=True)
class GgufSource:
    """What a GGUF input is, read from its header alone (no tensor is dequantized)."""

    path: str  # where it was read (not part of the record in the dequantized directory: content, not place)
    sha256: str
    size_bytes: int
    architecture: str  # as the file names it (general.architecture)
    model_type: str  # the Hugging Face model type transformers maps it to
    tensor_types: dict[str, int] = field(default_factory=dict)  # e.g. {"Q4_1": 210, "F32": 61, "Q8_0": 1}

    @property
    def quant_types(self) -> str:
        """The quantization types, most frequent first (`Q4_1,F32,Q8_0`): what lineage records."""
        return ",".join(name for name, _ in sorted(self.tensor_types.items(), key=lambda kv: (-kv[1], kv[0])))

    def to_json(self) -> dict:
        """The record kept beside the dequantized weights: the file's name and content, not where it was."""
        record = {**asdict(self), "file": Path(self.path).name, "quant_types": self.quant_types}
        del record["path"]
        return record


def is_gguf(model_id: str) -> bool:
    """True for an existing file that starts with the GGUF magic (or a name ending in .gguf)."""
    path = Path(model_id).expanduser()
    if path.is_file():
        with path.open("rb") as fh:
            return fh.read(4) == MAGIC or path.suffix.lower() == ".gguf"
    return path.suffix.lower() == ".gguf"


def inspect_gguf(path: str | Path) -> GgufSource:
    """Read the header; refuse what transformers cannot read or pipprune cannot prune, naming the architecture."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    from pip_core import families

    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise GgufError(f"model not found: GGUF file {path} does not exist")
    with path.open("rb") as fh:
        if fh.read(4) != MAGIC:
            raise GgufError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = GGUFReader(str(path))
        arch_field = reader.fields["general.architecture"]
        architecture = bytes(arch_field.parts[arch_field.data[0]]).decode()
    except (KeyError, ValueError, IndexError) as exc:
        raise GgufError(f"{path} is not a readable GGUF file: {exc}") from exc
    tensor_types = dict(Counter(t.tensor_type.name for t in reader.tensors))
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise GgufError(f"GGUF architecture {architecture!r} in {path.name} cannot be read by transformers "
                        f"(it reads: {', '.join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ('general', 'tokenizer'))})")
    try:
        config = load_gguf_checkpoint(str(path), return_tensors=False)["config"]  # header only
    except (ValueError, KeyError) as exc:
        raise GgufError(f"GGUF architecture {architecture!r} in {path.name}: transformers cannot read it ({exc})") from exc
    model_type = str(config.get("model_type"))
    try:
        families.family_for(model_type)
    except families.UnsupportedFamilyError:
        raise GgufError(f"GGUF architecture {architecture!r} (model_type={model_type!r}) in {path.name} is not a family "
                        f"pipprune prunes: {families.supported()}") from None
    return GgufSource(path=str(path), sha256=sha256_file(path), size_bytes=path.stat().st_size,
                      architecture=architecture, model_type=model_type, tensor_types=tensor_types)


def cache_dir_for(source: GgufSource, cache_root: Path) -> Path:
    """The content-addressed directory of a GGUF file's dequantized weights."""
    return cache_root / "gguf" / f"{source.sha256[:24]}-f32"


def read_source_record(model_dir: str | Path) -> dict | None:
    """The GGUF provenance of a dequantized directory (None for any other directory)."""
    path = Path(model_dir) / SOURCE_RECORD
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def dequantize_to_dir(source: GgufSource, out: Path) -> Path:
    """Write `source` as a float32 Hugging Face directory at `out` (once: an existing one is reused).

    Written to a private sibling and renamed into place, so a crash never leaves a directory that
    looks finished; two processes converting the same file at once both end with the same bytes.
    """
    record = read_source_record(out)
    if record is not None and record.get("sha256") == source.sha256:
        return out
    if out.exists():
        raise GgufError(f"{out} exists and does not hold the dequantized {Path(source.path).name}; remove it "
                        "(it is pipprune's cache) and run again")
    name = Path(source.path).name
    log.info("dequantizing %s (%s, %.0f MB) into %s", name, source.quant_types, source.size_bytes / 2**20, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        _write_dequantized(source, tmp)
        release_free_heap()  # the dequantized tensors are freed: their pages go back before the run reads the model
        (tmp / SOURCE_RECORD).write_text(json.dumps(source.to_json(), indent=1, sort_keys=True))
        try:
            tmp.rename(out)
        except OSError:  # another process finished the same file first: same content address
            shutil.rmtree(tmp, ignore_errors=True)
            if (read_source_record(out) or {}).get("sha256") != source.sha256:
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_dequantized(source: GgufSource, tmp: Path) -> None:
    """The float32 model and tokenizer of `source` saved into `tmp` (its tensors are freed when this returns)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(Path(source.path).parent), Path(source.path).name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.quantization_config = None  # transformers refuses to save a model it marks as GGUF-quantized
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):  # the plain model takes the loaded tensors themselves: no second copy of them
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise GgufError(f"{name}: dequantized weights do not fit the {source.model_type} layout "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    plain.tie_weights()
    del loaded
    plain.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
    for extra in tmp.iterdir():  # keep the model and its tokenizer, nothing else transformers may add
        if extra.is_file() and extra.suffix not in (".json", ".safetensors", ".jinja") and extra.name not in _TOKENIZER_FILES:
            extra.unlink()
