"""Where and in which dtype a model runs: one decision used by the loader, the scorer, `plan` and preflight.

`auto` dtype is the checkpoint's own (config `dtype`/`torch_dtype`); `auto` device is CUDA when
present, else the CPU. The memory plan of that dtype on that device then decides, in order:
whole model on the device; the same with gradient checkpointing (activations of one layer);
`device_map="auto"` across the visible GPUs with CPU offload (CUDA only); else it does not fit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from pip_core.errors import PipCoreError
from pip_core.memory_plan import MemoryPlan, available_bytes, plan_memory

DTYPES = ("bfloat16", "float16", "float32")
DEVICE_HELP = "auto | cpu | cuda | cuda:N"
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


class DeviceUnavailableError(PipCoreError):
    """The requested device does not exist on this machine."""


def check_device_spec(spec: str) -> str:
    """Syntax only (no hardware look-up): `auto`, `cpu`, `cuda` or `cuda:N`."""
    value = spec.strip().lower()
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise ValueError(f"unknown device {spec!r}; use {DEVICE_HELP}")


def check_dtype_spec(spec: str) -> str:
    value = _ALIASES.get(spec.strip().lower(), spec.strip().lower())
    if value == "auto" or value in DTYPES:
        return value
    raise ValueError(f"unknown dtype {spec!r}; use auto | {' | '.join(DTYPES)}")


def resolve_device(spec: str = "auto") -> str:
    """A concrete device name; a CUDA device that is not there is refused with what is there."""
    value = check_device_spec(spec)
    if value == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if value == "cpu":
        return value
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(f"--device {spec}: CUDA is not available on this machine "
                                     f"(torch {torch.__version__}, no visible GPU); use --device cpu or auto")
    index = int(value[5:]) if ":" in value else 0
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceUnavailableError(f"--device {spec}: this machine has {count} visible GPU(s) "
                                     f"(cuda:0..cuda:{count - 1})")
    return f"cuda:{index}"


def checkpoint_dtype(model_config: dict) -> str:
    """The dtype a checkpoint was saved in (float32 when its config does not say)."""
    raw = model_config.get("dtype") or model_config.get("torch_dtype") or "float32"
    value = str(raw).replace("torch.", "")
    return value if value in DTYPES else "float32"


def resolve_dtype(spec: str, model_config: dict) -> str:
    value = check_dtype_spec(spec)
    return checkpoint_dtype(model_config) if value == "auto" else value


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, check_dtype_spec(name))


@dataclass(frozen=True)
class Placement:
    """The decision, and the figures behind it (bytes)."""

    device: str
    dtype: str
    device_map: str | None
    gradient_checkpointing: bool
    fits: bool
    free_bytes: int
    plan: MemoryPlan
    lean: bool = False  # checkpointing chosen to keep the run's peak near its weights, not because memory is short

    def describe(self) -> str:
        if not self.fits:
            return (f"does not fit: PIP scoring needs {self.plan.peak_scoring / 2**30:.2f} GiB in {self.dtype} even "
                    f"with gradient checkpointing, {self.free_bytes / 2**30:.2f} GiB is free on {self.device}")
        where = (f"device_map='auto' across the visible GPUs with CPU offload (weights exceed {self.device})"
                 if self.device_map else f"whole model on {self.device}")
        why = ("activations of all layers would outweigh the activation budget" if self.lean
               else "activations of all layers do not fit")
        ckpt = f", gradient checkpointing on ({why})" if self.gradient_checkpointing else ""
        return f"{where}, {self.dtype}{ckpt}"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "plan": self.plan.as_dict(), "summary": self.describe()}


def _offload_bytes() -> int:
    """Free memory of every visible GPU plus the host's: what device_map='auto' can spread a model over."""
    gpus = sum(available_bytes(f"cuda:{i}") for i in range(torch.cuda.device_count()))
    return gpus + available_bytes("cpu")


def plan_placement(model_config: dict, device: str = "auto", dtype: str = "auto", seq_len: int = 128,
                   free_bytes: int | None = None, offload_bytes: int | None = None,
                   activation_budget: float | None = None) -> Placement:
    """Decide device, dtype, device map and gradient checkpointing from the config alone (no weights loaded).

    `free_bytes` / `offload_bytes` override the measured free memory of the device / of all GPUs + host;
    `activation_budget` (see `decide`) trades recomputation for a peak near the weights.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, model_config)
    free = available_bytes(dev) if free_bytes is None else free_bytes
    return decide(model_config, dev, dt, seq_len, free, offload_bytes, activation_budget)


def decide(model_config: dict, device: str, dtype: str, seq_len: int, free: int,
           offload_bytes: int | None = None, activation_budget: float | None = None) -> Placement:
    """The decision for a resolved device and dtype with `free` bytes on it (pure but for `offload_bytes=None`).

    With `activation_budget` set, gradient checkpointing is also chosen when storing every layer's
    activations would take more than that fraction of the weights: a run's peak memory is what a
    user sizes the machine by, and on small models the activations, not the weights, set it.
    """
    dev, dt = device, dtype
    full = plan_memory(model_config, dtype=dt, seq_len=seq_len)
    lean = activation_budget is not None and full.activations > activation_budget * full.weights
    if full.peak_scoring <= free and not lean:
        return Placement(dev, dt, None, False, True, free, full)
    ckpt = plan_memory(model_config, dtype=dt, seq_len=seq_len, gradient_checkpointing=True)
    if ckpt.peak_scoring <= free:
        return Placement(dev, dt, None, True, True, free, ckpt, lean=full.peak_scoring <= free)
    if dev.startswith("cuda"):
        spread = _offload_bytes() if offload_bytes is None else offload_bytes
        return Placement(dev, dt, "auto", True, ckpt.peak_scoring <= spread, spread, ckpt)
    return Placement(dev, dt, None, True, False, free, ckpt)
