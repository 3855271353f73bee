"""The compute precision of a run: ``fp32``, or ``bf16`` for the convolutions where the hardware runs it natively.

``--precision bf16`` runs the conv encoder (acting, and the update's forward or replayed backward) in bfloat16;
everything else stays float32: the shared weights and their gradients, the optimizer statistics, the LSTM and its
state, the heads, the returns, GAE, advantages and loss sums (docs/design.md, "Precision"). ``auto`` resolves to
``bf16`` where that pays and to ``fp32`` elsewhere:

- a CPU has native bf16 when it has the AVX-512 BF16 or AMX-BF16 instructions (``avx512_bf16`` / ``amx_bf16`` in
  ``/proc/cpuinfo``; torch's own CPU feature probe where it has one). Without them bf16 is emulated and slower
  than fp32 (about 2x on an AVX-512 Xeon without ``avx512_bf16``).
- a CUDA device has it from compute capability 8.0 on (Ampere, Hopper, ...); older GPUs emulate it.

The files a run writes stay float32 in either precision, so a run resumes in the other one.
"""
from __future__ import annotations

from pathlib import Path

import torch

PRECISIONS = ("fp32", "bf16", "auto")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The feature flags of the first CPU in ``cpuinfo`` (empty where there is no such file)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_has_native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """True when the CPU runs bf16 convolutions and matrix products natively (see the module docstring)."""
    if cpu_flags(cpuinfo) & set(CPU_BF16_FLAGS):
        return True
    if str(cpuinfo) != "/proc/cpuinfo":
        return False
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(bool(p()) for p in probes if p is not None)


def device_has_native_bf16(device: torch.device) -> bool:
    """Native bf16 on ``device`` (a CPU, or a CUDA device)."""
    if device.type == "cuda":
        return _cuda_bf16(0 if device.index is None else device.index)
    return cpu_has_native_bf16()


def _cuda_bf16(index: int) -> bool:
    """CUDA device ``index`` exists and runs bf16 natively (compute capability 8.0+: Ampere, Hopper, ...)."""
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return False
    major, _ = torch.cuda.get_device_capability(index)
    return major >= 8


def resolve(requested: str, devices: list[torch.device]) -> tuple[str, list[str], list[str]]:
    """``(precision, errors, warnings)`` for ``--precision requested`` on the compute ``devices`` of a run.

    ``auto`` is ``bf16`` when every device has native bf16, else ``fp32``. ``bf16`` on a GPU without it is an
    error; on a CPU without it a warning (it runs, slower).
    """
    if requested not in PRECISIONS:
        return "fp32", [f"--precision {requested!r} is not one of {', '.join(PRECISIONS)}"], []
    native = {d: device_has_native_bf16(d) for d in devices}
    if requested == "auto":
        return ("bf16" if devices and all(native.values()) else "fp32"), [], []
    if requested == "fp32":
        return "fp32", [], []
    errors, warnings = [], []
    for d, ok in native.items():
        if ok:
            continue
        if d.type == "cuda":
            errors.append(f"--precision bf16: GPU {d.index} has no native bf16 (compute capability 8.0 or newer "
                          f"needed); use --precision fp32")
        else:
            warnings.append("--precision bf16 on a CPU without native bf16 (no avx512_bf16 or amx_bf16): it runs, "
                            "but slower than fp32 here")
    return "bf16", errors, sorted(set(warnings))


def compute_dtype(precision: str) -> torch.dtype:
    """The conv encoder's dtype for a resolved precision (``fp32`` or ``bf16``)."""
    return DTYPES[precision]
