"""GPU profiles the planner computes with: presets, flag overrides, and calibrated JSON files.

A profile holds what the memory and step-time models need of one GPU and its links:

- ``memory_bytes``: device memory (what ``torch.cuda.get_device_properties().total_memory`` reports).
- ``peak_flops``: dense bf16 tensor-core peak, FLOP/s: ``flops.peak_tflops`` (NVIDIA data
  sheets: A100 312, H100/H200 SXM 989.4 TFLOP/s), the figure MFU is measured against.
- ``gemm_efficiency``: the fraction of the peak cuBLAS reaches on large bf16 GEMMs; smaller GEMM
  dimensions get less through the saturating curve of ``planner.cost.gemm_efficiency``.
- ``attention_efficiency``: the fraction of the peak the flash/cuDNN attention kernels reach at
  seq 2,048 and head dim 128; ``planner.cost.attention_efficiency`` carries it to other shapes.
- ``grouped_gemm_efficiency``: the routed experts' grouped GEMMs (``torch._grouped_mm``, forward +
  backward) as tiles and waves over ``sm_count`` SMs (``planner.cost.grouped_gemm_seconds``): the
  fraction of an SM's share of the peak a tile's FLOPs run at, plus ``grouped_wave_s`` seconds a
  wave. The presets take 1.0 and 7.0 µs, the H200's kernel as ``plan --calibrate`` timed it alone
  at mixtral-small's shape (8 experts × 4,096 rows × 1,024 × 3,584: 3.080 ms a layer, 120 waves)
  and e16-top4's (16 × 2,048 × 1,024 × 1,792: 1.681 ms, 79 waves): 6.9 and 7.0 µs a wave at the
  full tile rate (bench/results.jsonl, grouped_gemm_calibrate, 2026-12-03); ``plan --calibrate``
  on an MoE model measures both at two shapes.
- ``sm_count``: streaming multiprocessors (NVIDIA data sheets: H100/H200 SXM 132, A100 108).
- ``hbm_bytes_per_s``: achievable device-memory bandwidth (copy kernels; about 85% of the data sheet).
- ``intra_node_bytes_per_s`` / ``inter_node_bytes_per_s``: achievable NCCL bus bandwidth per GPU inside
  a node (NVLink) and across nodes (one 200/400 Gb/s NIC per GPU), the ``busbw`` of nccl-tests, so a
  ring all-reduce of B bytes over n ranks takes 2(n−1)/n · B / bandwidth.

Preset figures. Memory, peak and link speeds are NVIDIA data-sheet figures (A100 SXM4 80GB: HBM2e
2.04 TB/s, NVLink 3 600 GB/s both directions; H100 SXM5: HBM3 3.35 TB/s, NVLink 4 900 GB/s; H200 SXM:
HBM3e 4.8 TB/s, NVLink 4; HDR InfiniBand 200 Gb/s per A100, NDR 400 Gb/s per H100/H200), derated to
achievable: HBM × 0.85, NVLink per direction × 0.8, NIC × 0.9. The efficiencies are calibrated on this
project's H200 measurements (bench/RESULTS.md, 2026-12-01, llama-1b at micro-batch 8, seq 2048: GEMMs
148.3 ms for 105 TFLOP = 0.72 of peak; flash attention 21.7 ms for 13.2 TFLOP = 0.61) and used for the
other Hopper/Ampere presets alike. H200 memory is the lent machine's 143,771 MiB.

- ``fp8_gemm_speedup`` and ``fp8_half_dim``: how many times faster a large FP8 GEMM
  (``torch._scaled_mm``, E4M3) runs than the same bf16 GEMM, and the GEMM dimension at which FP8's
  size curve reaches half its rate (bf16's is ``cost.GEMM_HALF_DIM``): ``cost.fp8_speedup`` gives
  the speed-up at a layer's shapes. 1 and 64 where the GPU has no FP8 tensor cores (A100) and on CPU
  (FP8 is emulated there): no speed-up at any size. Hopper: 2.0 (the data sheet's FP8 peak over
  bf16's) and 64, bf16's own curve: a per-kernel profile of an FP8 step on the H200 (gpt3-2.7b
  widths, 4,096 tokens: 96 FP8 GEMMs in 10.68 ms, 2.03× the bf16 model's time; bench/RESULTS.md
  2026-12-04 session 13) found no extra size penalty at these shapes (the 256 fitted before took
  host-bound and cast time as slow GEMMs); ``plan --calibrate`` measures both at two sizes.
- ``host_scale``: this machine's host (CPU) time for the same launches over the H200 host's, on
  which planner/host.py's constants were measured (1 on the presets; ``plan --calibrate`` times a
  burst of small kernel launches against the H200 host's, ``host.REFERENCE_LAUNCH_S``).

``meshlm plan --calibrate`` measures a profile on this machine and writes it as JSON to
``$XDG_CACHE_HOME/meshlm/gpus/<name>.json`` (default ``~/.cache/meshlm/gpus/``), or to
``--gpu-profile PATH``; ``--gpu NAME`` then finds it by name, ``--gpu-profile PATH`` by path.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import ConfigError
from ..flops import device_words, peak_tflops

GiB = 2 ** 30
COLLECTIVE_LATENCY_S = 20e-6  # the start-up cost of one collective or p2p exchange, every link alike


@dataclass(frozen=True)
class GPU:
    """One GPU kind and its links; units: bytes, FLOP/s, bytes/s (see the module docstring)."""

    name: str
    memory_bytes: float
    peak_flops: float
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    gemm_efficiency: float = 0.77
    attention_efficiency: float = 0.61
    source: str = "preset"
    grouped_gemm_efficiency: float = 1.0
    fp8_gemm_speedup: float = 1.0
    sm_count: int = 132
    grouped_wave_s: float = 7.0e-6
    fp8_half_dim: float = 64.0
    host_scale: float = 1.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _preset(name: str, device_name: str, memory_bytes: float, hbm: float, nvlink_per_direction: float,
            nic_gbit: float, fp8: tuple = (1.0, 64.0), sm_count: int = 132) -> GPU:
    return GPU(name=name, memory_bytes=memory_bytes, peak_flops=peak_tflops(device_name, torch.bfloat16) * 1e12,
               hbm_bytes_per_s=0.85 * hbm, intra_node_bytes_per_s=0.8 * nvlink_per_direction,
               inter_node_bytes_per_s=0.9 * nic_gbit / 8 * 1e9, fp8_gemm_speedup=fp8[0], fp8_half_dim=fp8[1],
               sm_count=sm_count)


FP8_HOPPER = (2.0, 64.0)  # large-GEMM speed-up over bf16 and FP8's half-rate dimension (see the module doc)

PRESETS = {
    "A100-80GB": _preset("A100-80GB", "NVIDIA A100-SXM4-80GB", 80 * GiB, 2.039e12, 300e9, 200, sm_count=108),
    "H100-80GB": _preset("H100-80GB", "NVIDIA H100 80GB HBM3", 80 * GiB, 3.35e12, 450e9, 400, FP8_HOPPER),
    "H200-141GB": _preset("H200-141GB", "NVIDIA H200", 143771 * 2 ** 20, 4.8e12, 450e9, 400, FP8_HOPPER),
}

_PRESETS_UPPER = {k.upper(): k for k in PRESETS}

# --gpu-* override flags: flag suffix → (field, factor from the flag's unit to the field's)
OVERRIDES = {
    "memory-gib": ("memory_bytes", GiB),
    "tflops": ("peak_flops", 1e12),
    "hbm-gbps": ("hbm_bytes_per_s", 1e9),
    "nvlink-gbps": ("intra_node_bytes_per_s", 1e9),
    "internode-gbps": ("inter_node_bytes_per_s", 1e9),
    "gemm-efficiency": ("gemm_efficiency", 1.0),
}


def profile_dir() -> str:
    """Where --calibrate stores profiles: $XDG_CACHE_HOME/meshlm/gpus (default ~/.cache/meshlm/gpus)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "meshlm", "gpus")


def slug(device_name: str) -> str:
    """A file name for a device name: 'NVIDIA H200' → 'NVIDIA-H200'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", device_name).strip("-") or "device"


def save_profile(gpu: GPU, path: Optional[str] = None) -> str:
    """Write ``gpu`` as JSON to ``path`` (default profile_dir()/<name>.json); return the path."""
    path = path or os.path.join(profile_dir(), f"{slug(gpu.name)}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(gpu.to_json(), fh, indent=1)
    return path


def load_profile(path: str) -> GPU:
    """A profile JSON written by save_profile. ConfigError if missing or malformed, or when a value
    is not of its kind (``profile_problem``: a peak of 0 was a ZeroDivisionError, a string a
    TypeError, a negative one a plan of negative times)."""
    try:
        with open(path) as fh:
            data = json.load(fh)
        gpu = GPU(**{f.name: data[f.name] for f in dataclasses.fields(GPU) if f.name in data})
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"--gpu-profile {path}: not a meshlm GPU profile ({e}); write one with "
                          f"`meshlm plan --calibrate`") from None
    problem = profile_problem(gpu)
    if problem:
        raise ConfigError(f"--gpu-profile {path}: {problem}; fix it, or write it again with `meshlm plan --calibrate`")
    return gpu


def profile_problem(gpu: GPU) -> Optional[str]:
    """The first field of a loaded profile that is not of its kind, in words, or None: the name a
    string, every other field a finite number above 0 (``grouped_wave_s`` may be 0), ``sm_count`` an
    integer, ``gemm_efficiency`` at most 1 (as --gpu-gemm-efficiency)."""
    if not isinstance(gpu.name, str) or not gpu.name:
        return f"name is {gpu.name!r}, not a device name"
    for f in dataclasses.fields(GPU):
        v = getattr(gpu, f.name)
        if f.name in ("name", "source"):
            continue
        low = 0 if f.name == "grouped_wave_s" else None
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not number or (v < 0 if low == 0 else v <= 0) or (f.name == "sm_count" and v != int(v)) \
                or (f.name == "gemm_efficiency" and v > 1):
            limit = "an integer above 0" if f.name == "sm_count" else "a finite number at most 1 and above 0" \
                if f.name == "gemm_efficiency" else "a finite number, 0 or more" if low == 0 else \
                "a finite number above 0"
            return f"{f.name} is {v!r}, not {limit}"
    return None


def resolve_gpu(name: str, profile: Optional[str] = None, overrides: Optional[dict] = None) -> GPU:
    """The GPU the planner uses: --gpu-profile PATH, else the preset --gpu NAME, else a calibrated
    profile of that name in profile_dir(); then each given override (OVERRIDES keys, in the flags'
    units). ConfigError naming the presets when nothing matches, or when both a name and a profile
    are given (the profile won, and a plan for "--gpu A100-80GB" was silently another GPU's)."""
    if profile and name:
        raise ConfigError(f"--gpu {name} and --gpu-profile {profile} name two GPUs; give one of them")
    if profile:
        gpu = load_profile(profile)
    elif name.upper() in _PRESETS_UPPER:  # preset names match in any case: --gpu h100-80gb
        gpu = PRESETS[_PRESETS_UPPER[name.upper()]]
    elif os.path.exists(os.path.join(profile_dir(), f"{slug(name)}.json")):
        gpu = load_profile(os.path.join(profile_dir(), f"{slug(name)}.json"))
    else:
        raise ConfigError(f"--gpu {name!r} is neither a preset ({', '.join(PRESETS)}) nor a calibrated profile "
                          f"in {profile_dir()}; run `meshlm plan --calibrate` on that GPU or pass --gpu-profile")
    bad = [f"--gpu-{k} {v:g}: give a finite number above 0" + (" and at most 1" if k == "gemm-efficiency" else "")
           for k, v in (overrides or {}).items()
           if v is not None and not (0 < v <= 1 if k == "gemm-efficiency" else 0 < v < float("inf"))]
    if bad:
        raise ConfigError(bad)
    changes = {OVERRIDES[k][0]: v * OVERRIDES[k][1] for k, v in (overrides or {}).items() if v is not None}
    return dataclasses.replace(gpu, **changes) if changes else gpu


DEVICE_PRESETS = (("H200", "H200-141GB"), ("H100", "H100-80GB"), ("H800", "H100-80GB"),
                  ("A100", "A100-80GB"), ("A800", "A100-80GB"))  # a word of the device name → preset


def gpu_of_device(device_name: Optional[str], fallback: str = "H200-141GB") -> tuple:
    """(GPU, where it came from) for the device a run recorded (metrics.jsonl's ``device``, e.g.
    "NVIDIA H200" or "cpu"): a calibrated profile of that name in profile_dir(), else the preset
    one of whose words the device name has (``flops.device_words``: "NVIDIA L40" is no L4), with the
    device's own data-sheet peak (``flops.peak_tflops``: an "H100 PCIe" is not the SXM part), else the
    ``fallback`` preset, said so in the second item."""
    if device_name:
        path = os.path.join(profile_dir(), f"{slug(device_name)}.json")
        if os.path.exists(path):
            return load_profile(path), f"calibrated profile {path}"
        words = device_words(device_name)
        for needle, preset in DEVICE_PRESETS:
            if needle in words:
                gpu = PRESETS[preset]
                peak = peak_tflops(device_name, torch.bfloat16)
                if peak and peak * 1e12 != gpu.peak_flops:
                    gpu = dataclasses.replace(gpu, name=device_name, peak_flops=peak * 1e12)
                    return gpu, f"preset {preset} at the {device_name}'s peak {peak:g} TFLOP/s"
                return gpu, f"preset {preset} (the run's device {device_name})"
    where = f"the run's device {device_name} has no profile" if device_name else "the run recorded no device"
    return PRESETS[fallback], (f"preset {fallback}: {where}; `meshlm plan --calibrate` on that machine "
                               f"stores one")

