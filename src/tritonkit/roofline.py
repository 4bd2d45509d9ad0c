"""The roofline model: what an op must move and compute, against what the device can do.

``t_roof = max(bytes / bandwidth, flops / peak[unit])`` and ``pct = t_roof / t_measured``.

Two kinds of ceiling:
- datasheet: dense peaks from the vendor's datasheet (never the 2:4-sparse figures);
- measured: a large device-to-device copy (bytes read + written) and a large cuBLAS matmul per
  dtype, measured once per device and cached on disk, since no kernel beats those in practice.

Peak keys: ``bf16``, ``fp16``, ``fp8`` (tensor cores, dense), ``tf32`` (tensor cores) and
``fp32`` (plain CUDA-core FMA, the unit elementwise and reduction kernels use).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("tritonkit")

TERA = 1e12


@dataclass(frozen=True)
class Cost:
    """The minimal work of one call: floating-point operations and bytes through device memory."""

    flops: float
    bytes: float

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes)

    @property
    def intensity(self) -> float:
        """FLOPs per byte; compare with a device's ridge point (peak / bandwidth)."""
        return self.flops / self.bytes if self.bytes else float("inf")


@dataclass(frozen=True)
class DeviceSpec:
    """Ceilings of one device: memory bandwidth in bytes/s and peak rates in FLOP/s per unit."""

    name: str
    slug: str  # short name for result folders: benchmarks/results/<slug>/
    bandwidth: float
    peak_flops: dict[str, float] = field(default_factory=dict)
    source: str = "datasheet"  # or "measured"

    def peak(self, unit: str) -> float:
        if unit not in self.peak_flops:
            raise ValueError(f"{self.name} has no {unit!r} peak; known: {sorted(self.peak_flops)}")
        return self.peak_flops[unit]

    def ridge(self, unit: str) -> float:
        """Arithmetic intensity (FLOP/byte) above which an op is compute-bound."""
        return self.peak(unit) / self.bandwidth


def _hopper_sxm(name: str, slug: str, bandwidth: float) -> DeviceSpec:
    # H100 SXM datasheet, dense: 989 TFLOP/s bf16/fp16, 1979 fp8, 494.5 tf32, 67 fp32.
    # The H200 SXM has the same SMs and clocks, with HBM3e at 4.8 TB/s.
    peaks = {
        "bf16": 989 * TERA,
        "fp16": 989 * TERA,
        "fp8": 1979 * TERA,
        "tf32": 494.5 * TERA,
        "fp32": 67 * TERA,
    }
    return DeviceSpec(name, slug, bandwidth, peaks)


def _a100_sxm(name: str, slug: str, bandwidth: float) -> DeviceSpec:
    # A100 SXM datasheet, dense: 312 TFLOP/s bf16/fp16, 156 tf32, 19.5 fp32; no fp8 tensor cores.
    peaks = {"bf16": 312 * TERA, "fp16": 312 * TERA, "tf32": 156 * TERA, "fp32": 19.5 * TERA}
    return DeviceSpec(name, slug, bandwidth, peaks)


DATASHEETS: dict[str, DeviceSpec] = {
    "h200": _hopper_sxm("NVIDIA H200 SXM", "h200", 4.8 * TERA),
    "h100": _hopper_sxm("NVIDIA H100 SXM", "h100", 3.35 * TERA),
    "a100": _a100_sxm("NVIDIA A100 SXM 80GB", "a100", 2.039 * TERA),
    "a100-40gb": _a100_sxm("NVIDIA A100 SXM 40GB", "a100-40gb", 1.555 * TERA),
}


def slug_for_device_name(device_name: str) -> str:
    """Map a CUDA device name to a datasheet key; unknown parts raise rather than guess.

    The PCIe and NVL variants have other clocks and memory, so they are not matched to SXM specs.
    """
    name = device_name.upper()
    if any(variant in name for variant in ("PCIE", "NVL")):
        slug = None
    elif "H200" in name:
        slug = "h200"
    elif "H100" in name and ("SXM" in name or "HBM3" in name):
        slug = "h100"
    elif "A100" in name and "SXM" in name:
        slug = "a100-40gb" if "40GB" in name else "a100"
    else:
        slug = None
    if slug is None:
        raise ValueError(
            f"no datasheet for device {device_name!r}; known: {sorted(DATASHEETS)}. "
            "Pass a tritonkit.roofline.DeviceSpec for it (or --device with a known name)."
        )
    return slug


def device_spec(device: str | DeviceSpec | None = None) -> DeviceSpec:
    """The datasheet spec for a key ('h200'), a CUDA device name, a given spec, or the current GPU."""
    if isinstance(device, DeviceSpec):
        return device
    if device is None:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("no CUDA device: name one, e.g. device_spec('h200')")
        device = torch.cuda.get_device_name()
    key = device.lower()
    return DATASHEETS[key] if key in DATASHEETS else DATASHEETS[slug_for_device_name(device)]


def roofline_seconds(cost: Cost, spec: DeviceSpec, unit: str) -> float:
    """The least time the op can take on ``spec`` with its FLOPs on ``unit``."""
    return max(cost.bytes / spec.bandwidth, cost.flops / spec.peak(unit) if cost.flops else 0.0)


def pct_of_roofline(cost: Cost, seconds: float, spec: DeviceSpec, unit: str) -> float:
    """Percent of the roofline reached by a measured time (100 = at the ceiling)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    return 100.0 * roofline_seconds(cost, spec, unit) / seconds


def bound_by(cost: Cost, spec: DeviceSpec, unit: str) -> str:
    """'memory' or 'compute': which term of the roofline is larger."""
    compute = cost.flops / spec.peak(unit) if cost.flops else 0.0
    return "compute" if compute > cost.bytes / spec.bandwidth else "memory"


# ---------------------------------------------------------------- measured ceilings

COPY_BYTES = 1 << 30  # 1 GiB source: 20x the H100/H200 50 MB L2, so the copy streams from HBM
MATMUL_SIZE = 8192  # 8192^3 bf16 runs long enough (~1.4 ms) to reach the steady-state clock
CACHE_FILE = "ceilings.json"


def cache_dir() -> Path:
    """``$TRITONKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/tritonkit``, else ``~/.cache/tritonkit``."""
    if env := os.environ.get("TRITONKIT_CACHE_DIR"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tritonkit"


def _cache_key(device_name: str) -> str:
    import torch

    return f"{device_name}|torch {torch.__version__}|cuda {torch.version.cuda}"


def measured_ceilings(refresh: bool = False) -> DeviceSpec:
    """Measured ceilings of the current GPU, cached on disk per device and torch/CUDA version.

    Units that are not measured (fp32 CUDA-core FMA, tf32) keep their datasheet values.
    """
    import torch

    if not torch.cuda.is_available():
        raise ValueError("measured ceilings need a CUDA GPU")
    device_name = torch.cuda.get_device_name()
    path = cache_dir() / CACHE_FILE
    cached = json.loads(path.read_text()) if path.exists() else {}
    key = _cache_key(device_name)
    if refresh or key not in cached:
        log.info("tritonkit: measuring copy bandwidth and matmul rates on %s (once)", device_name)
        cached[key] = _measure(torch)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=1))
    record = cached[key]
    datasheet = device_spec(device_name)
    peaks = dict(datasheet.peak_flops) | {unit: tflops * TERA for unit, tflops in record["tflops"].items()}
    return dataclasses.replace(
        datasheet, bandwidth=record["copy_tbps"] * TERA, peak_flops=peaks, source="measured"
    )


def _measure(torch) -> dict:
    from tritonkit._runtime import interpret

    interpret()  # decide before triton is imported
    from triton.testing import do_bench

    record = {
        "copy_tbps": _copy_bytes_per_s(torch, do_bench) / TERA,
        "tflops": {},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    units = [("bf16", torch.bfloat16), ("fp16", torch.float16)]
    if torch.cuda.get_device_capability() >= (8, 9):
        units.append(("fp8", torch.float8_e4m3fn))
    for unit, dtype in units:
        record["tflops"][unit] = _matmul_flops_per_s(torch, do_bench, dtype) / TERA
    return record


def _copy_bytes_per_s(torch, do_bench) -> float:
    src = torch.randn(COPY_BYTES // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * COPY_BYTES / (ms * 1e-3)  # bytes read plus bytes written


def _matmul_flops_per_s(torch, do_bench, dtype) -> float:
    n = MATMUL_SIZE
    a = torch.randn(n, n, device="cuda").to(dtype)  # random, never zeros: zeros run faster
    b = torch.randn(n, n, device="cuda").to(dtype)
    if dtype == torch.float8_e4m3fn:
        one = torch.ones((), device="cuda")
        b_cols = b.t().contiguous().t()  # cuBLAS takes fp8 B column-major
        ms = do_bench(
            lambda: torch._scaled_mm(a, b_cols, one, one, out_dtype=torch.bfloat16), return_mode="median"
        )
    else:
        ms = do_bench(lambda: a @ b, return_mode="median")
    return 2 * n**3 / (ms * 1e-3)
