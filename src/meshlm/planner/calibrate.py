"""``meshlm plan --calibrate``: measure this machine's GPU (or CPU) and store it as a GPU profile.

Measured, each as the best of a few timed repeats after a warm-up:
- GEMM throughput at the model's shapes (the micro-batch's tokens × h × QKV width, × h × MLP width,
  × MLP width × h; bf16 on CUDA, fp32 on CPU); ``gemm_efficiency`` is the achieved fraction of the
  peak divided by ``cost.gemm_efficiency``'s size factor at those shapes, so the planner reproduces
  the measurement at the model's dimensions;
- for an MoE model (--num-experts), the routed experts' grouped GEMMs (``torch._grouped_mm``; fc1 of
  width (2 | 1)·f_e and fc2, forward and backward with both gradients) at two shapes, k·T/E rows an
  expert (balanced) and a quarter of that; ``grouped_gemm_efficiency`` (the tile rate) and
  ``grouped_wave_s`` (a wave's fixed cost) are the two constants of ``cost.grouped_gemm_seconds``
  that reproduce both times (``fit_grouped``); kept from the base profile for a dense model or a
  torch without ``_grouped_mm``;
- on a GPU with FP8 tensor cores, the same GEMMs in bf16 and as FP8 (``torch._scaled_mm``) at the
  model's widths and at half of them: the two speed-ups (bf16 time over FP8 time, the GEMMs alone;
  the casts are the step model's) give ``fp8_gemm_speedup`` and ``fp8_half_dim``, the two constants
  of ``cost.fp8_speedup`` (``fit_fp8``); each GEMM is timed over several back-to-back calls, so the
  launch and synchronisation of one call (~15 µs, a sixth of a small FP8 GEMM) is not counted;
- device-memory bandwidth: a copy of a large buffer (read + write bytes / time);
- the host: one small kernel launch's host time (``host.launch_seconds``) over the H200 host's
  (``host.REFERENCE_LAUNCH_S``) as ``host_scale``, which scales the planner's host-time model
  (on a CPU, kept from the base profile); a coarse measure: on one H200 host it read 7.6–11.3 µs
  within minutes (bench/RESULTS.md, session 15), so it tells a much slower host from the H200's, not 10%;
- with more than one CUDA device, the device-to-device copy bandwidth between GPUs 0 and 1 as the
  intra-node link (an estimate of NCCL's bus bandwidth; inter-node is kept from the base profile).
The peak is the data-sheet figure (``flops.peak_tflops``) where the device is known,
else (CPU, unknown GPUs) the best GEMM throughput measured. ``quick`` uses small shapes (tests).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional

import torch

from ..config import Config, ffn_hidden, head_dim, moe_ffn, query_groups
from ..flops import peak_tflops
from . import host
from .cost import GEMM_HALF_DIM, gemm_efficiency, grouped_gemm_terms
from .gpus import GPU, PRESETS


def _best(fn, repeats: int, sync, calls: int = 1) -> float:
    """Seconds of one fn() call: the best of ``repeats`` timings of ``calls`` back-to-back calls."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


CPU_FLOP_BUDGET = 1e13  # a full calibration on a CPU above this: ~2 minutes or more of GEMMs at CPU_FLOPS, silent
CPU_FLOPS = 1e11  # a CPU's fp32 GEMM rate, roughly (a loaded 2-core one measured 0.0014-0.2 TFLOP/s)


def cpu_work_problem(cfg: Config, quick: bool) -> Optional[str]:
    """One line when --calibrate without --quick would time the model's full-size GEMMs on a CPU
    (no CUDA) for more than ``CPU_FLOP_BUDGET`` FLOPs (10 × 10 passes of the three GEMMs of
    ``calibrate``: llama3-8b's are 9e14, hours at a CPU's 0.1 TFLOP/s, which looked like a hang);
    else None. The attention projection and MoE's grouped GEMMs are left out (a lower bound)."""
    if quick or torch.cuda.is_available():
        return None
    m = cfg.model
    h, f = m.hidden_size, ffn_hidden(m)
    qkv = (m.num_attention_heads + 2 * query_groups(m)) * head_dim(m)
    tokens = cfg.training.micro_batch_size * m.seq_length
    work = 100 * 2.0 * tokens * h * (qkv + 2 * f)
    if work <= CPU_FLOP_BUDGET:
        return None
    return (f"--calibrate on a CPU would time this model's full-size GEMMs, {work:.1e} FLOPs (about "
            f"{work / CPU_FLOPS / 60:,.0f} min at {CPU_FLOPS / 1e12:g} TFLOP/s, printing nothing meanwhile); add --quick "
            f"(small shapes, seconds) or run it on the GPU you plan for")


def calibrate(cfg: Config, *, quick: bool = False, base: GPU = PRESETS["H200-141GB"]) -> GPU:
    """A GPU profile measured on this machine for cfg's model shapes (see the module docstring)."""
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    m = cfg.model
    h, f = m.hidden_size, ffn_hidden(m)
    qkv = (m.num_attention_heads + 2 * query_groups(m)) * head_dim(m)
    attn = m.num_attention_heads * head_dim(m)
    tokens = cfg.training.micro_batch_size * m.seq_length
    if quick:
        h, f, qkv, attn, tokens = min(h, 256), min(f, 512), min(qkv, 384), min(attn, 256), min(tokens, 256)
    shapes = [(tokens, h, qkv), (tokens, h, f), (tokens, f, h)]
    repeats, calls = (3, 1) if quick else (10, 10)
    seconds = _bf16_seconds(shapes, repeats, calls, dev, dtype, sync)
    achieved = sum(2.0 * mm * k * n for mm, k, n in shapes) / seconds
    fp8, half_dim, fp8_note = 1.0, float(GEMM_HALF_DIM), "no FP8 tensor cores (FP8 runs at bf16's rate)"
    if cuda and torch.cuda.get_device_capability() >= (8, 9):
        halves = [(mm, max(16, k // 32 * 16), max(16, n // 32 * 16)) for mm, k, n in shapes]
        r1 = seconds / _fp8_seconds(shapes, repeats, calls, sync)
        r2 = _bf16_seconds(halves, repeats, calls, dev, dtype, sync) / _fp8_seconds(halves, repeats, calls, sync)
        fp8, half_dim = fit_fp8([(r1, (tokens, h, attn, f)), (r2, (tokens, h / 2, attn / 2, f / 2))])
        fp8_note = f"FP8 {r1:.2f}× faster at the model's widths, {r2:.2f}× at half → {fp8:.2f}× on large GEMMs, " \
                   f"half rate at {half_dim:.0f}"
    grouped = _grouped(cfg, tokens, quick, dev, dtype, sync)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = (peak_tflops(name, torch.bfloat16) or 0) * 1e12 if cuda else 0.0
    peak = peak or achieved
    size = gemm_efficiency(replace(base, gemm_efficiency=1.0), tokens, h, qkv, f)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else base.sm_count
    grouped_eff, wave_s = base.grouped_gemm_efficiency, base.grouped_wave_s
    grouped_note = "grouped GEMM not measured (no experts or no _grouped_mm)"
    if grouped:
        grouped_eff, wave_s = fit_grouped(replace(base, peak_flops=peak, sm_count=sms), grouped)
        grouped_note = "grouped GEMM " + ", ".join(f"{1e3 * t:.3f} ms at (experts, rows, h, f_e, gates) {shape}"
                                                   for t, shape in grouped) \
            + f" → {grouped_eff:.3f} of the tile rate, {1e6 * wave_s:.2f} µs a wave"
    n = (16 if quick else 512) * 2 ** 20
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    hbm = 2 * n / _best(lambda: dst.copy_(src), 3 if quick else 10, sync)
    props = torch.cuda.get_device_properties(0) if cuda else None
    memory = props.total_memory if cuda else base.memory_bytes
    link, link_note = base.intra_node_bytes_per_s, f"links not measured (one device: {base.name}'s)"
    if cuda and torch.cuda.device_count() > 1:
        link_note = "GPU 0 → 1 copy as the intra-node link"
        other = torch.empty(n, dtype=torch.uint8, device="cuda:1")
        link = n / _best(lambda: other.copy_(src), 5, lambda: (torch.cuda.synchronize(0), torch.cuda.synchronize(1)))
    launch = host.launch_seconds(dev, 200 if quick else 2000)
    host_scale = launch / host.REFERENCE_LAUNCH_S if cuda else base.host_scale  # on a CPU, the host is the device
    return replace(base, name=name, memory_bytes=memory, host_scale=host_scale, peak_flops=peak, hbm_bytes_per_s=hbm,
                   intra_node_bytes_per_s=link, gemm_efficiency=min(1.0, achieved / peak / size),
                   fp8_gemm_speedup=fp8, fp8_half_dim=half_dim, grouped_gemm_efficiency=grouped_eff, grouped_wave_s=wave_s, sm_count=sms,
                   source=f"measured by meshlm plan --calibrate on {name} ({'quick' if quick else 'full'} shapes "
                          f"{shapes}; GEMM {achieved / 1e12:.3g} TFLOP/s; {fp8_note}; {grouped_note}; "
                          f"memory copy {hbm / 1e9:.1f} GB/s; a kernel launch {1e6 * launch:.1f} µs on the host; "
                          f"{link_note})")


def _bf16_seconds(shapes: list, repeats: int, calls: int, dev, dtype, sync) -> float:
    """Seconds of one pass of the (M, K, N) GEMMs, summed."""
    seconds = 0.0
    for mm, k, n in shapes:
        a = torch.randn(mm, k, device=dev, dtype=dtype)
        b = torch.randn(k, n, device=dev, dtype=dtype)
        seconds += _best(lambda: a @ b, repeats, sync, calls)
    return seconds


def _fp8_seconds(shapes: list, repeats: int, calls: int, sync) -> float:
    """Seconds of the same GEMMs in FP8 (torch._scaled_mm, E4M3, row-major × column-major, bf16 out)."""
    one = torch.ones((), device="cuda")
    seconds = 0.0
    for mm, k, n in shapes:
        a = torch.randn(mm, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()
        seconds += _best(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                         repeats, sync, calls)
    return seconds


def fit_fp8(measured: list) -> tuple:
    """(fp8_gemm_speedup, fp8_half_dim) that make ``cost.fp8_speedup`` equal two measured speed-ups
    [(bf16 time / FP8 time, GEMM dimensions)], the first at larger dimensions than the second: the
    half-dim from the ratio of the two (bisection over [1, 65536]: the ratio rises with it), then the
    large-GEMM speed-up from the first. A second speed-up at least the first's (no size effect seen)
    gives the first at bf16's half-dim."""
    (r1, d1), (r2, d2) = measured

    def curve(dims, half):
        out = 1.0
        for x in dims:
            out *= (x + GEMM_HALF_DIM) / (x + half)
        return out

    if r2 >= r1:
        return r1, float(GEMM_HALF_DIM)
    lo, hi = 1.0, 65536.0
    for _ in range(100):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if curve(d1, mid) / curve(d2, mid) < r1 / r2 else (lo, mid)
    half = (lo * hi) ** 0.5
    return r1 / curve(d1, half), half


def _grouped(cfg: Config, tokens: int, quick: bool, dev, dtype, sync):
    """[(seconds, (experts, rows, h, f_e, gates))] of one MoE layer's expert GEMMs, forward +
    backward (``torch._grouped_mm``: x [E·rows, h] × [E, h, (2 | 1)·f_e], then [E·rows, f_e] × [E,
    f_e, h], both inputs' gradients and both weights'), at two shapes: rows = k·T/E a local expert
    (balanced routing, rounded up to 16) and a quarter of it (fewer waves a GEMM, so the per-wave
    cost and the tile rate separate); each the best of a few repeats. None for a dense model or a
    torch without ``_grouped_mm``."""
    m = cfg.model
    if not m.num_experts or not hasattr(torch, "_grouped_mm"):
        return None
    E, h, f_e, gates = m.num_experts, m.hidden_size, moe_ffn(m), 2 if m.swiglu else 1
    if quick:
        E, h, f_e = min(E, 4), min(h, 128), min(f_e, 128)
    full = -(-m.moe_router_topk * tokens // (E * 16)) * 16
    out = []
    for rows in (full, -(-full // 64) * 16):
        offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * rows
        x1 = torch.randn(E * rows, h, device=dev, dtype=dtype, requires_grad=True)
        x2 = torch.randn(E * rows, f_e, device=dev, dtype=dtype, requires_grad=True)
        w1 = torch.randn(E, h, gates * f_e, device=dev, dtype=dtype, requires_grad=True)
        w2 = torch.randn(E, f_e, h, device=dev, dtype=dtype, requires_grad=True)
        g1 = torch.randn(E * rows, gates * f_e, device=dev, dtype=dtype)
        g2 = torch.randn(E * rows, h, device=dev, dtype=dtype)

        def step():
            torch.autograd.backward([torch._grouped_mm(x1, w1, offs=offs), torch._grouped_mm(x2, w2, offs=offs)],
                                    [g1, g2], inputs=[x1, x2, w1, w2])
            x1.grad = x2.grad = w1.grad = w2.grad = None
        out.append((_best(step, 3 if quick else 10, sync), (E, rows, h, f_e, gates)))
    return out


def fit_grouped(gpu: GPU, measured: list) -> tuple:
    """(grouped_gemm_efficiency, grouped_wave_s) that make ``cost.grouped_gemm_seconds`` equal two
    measurements [(seconds, (experts, rows, h, f_e, gates))]: t_i = full_i / eff + waves_i · τ
    solved for 1/eff and τ; τ clamped at 0 (then eff from the larger shape alone) and eff at 1."""
    (t1, s1), (t2, s2) = measured
    (f1, w1), (f2, w2) = grouped_gemm_terms(gpu, *s1), grouped_gemm_terms(gpu, *s2)
    det = f1 * w2 - f2 * w1
    inv = (t1 * w2 - t2 * w1) / det if det else 0.0
    tau = (f1 * t2 - f2 * t1) / det if det else -1.0
    if tau < 0 or inv <= 0:
        tau, inv = 0.0, t1 / f1
    return min(1.0, 1 / inv), tau
