"""MoE benchmark (issues 14, 31): a Mixtral-shaped model at EP=1 in meshlm against a plain-PyTorch MoE
of the same shape (bench/baseline.py --experts) and against the dense model of the same active FLOPs
per token, in one invocation, on one GPU.

Usage (lent H200, repository root):
    PYTHONPATH=src python bench/moe_bench.py --out $OUT --results $OUT/results.jsonl --date 2026-12-02
    PYTHONPATH=src python bench/moe_bench.py --tiny --out /tmp/moe-bench   # CPU smoke test (seconds)

Shape: preset ``mixtral-small`` (16 layers, h 1024, 16 heads / 8 KV groups, 8 SwiGLU experts of
3584, top-2, load-balancing coefficient 1e-2), vocabulary 32000, sequence 2048, bf16,
--mock-data; --tiny: preset ``mixtral-tiny`` at sequence 128 on CPU. Cases (--cases, in order,
each its own process; the median of the iterations after --warmup, wall clock of the whole step):
baseline (plain PyTorch), learned (meshlm, default fast path, learned routing with the aux loss),
balanced (--moe-router-force-load-balancing: random logits, the load even in expectation),
capacity (--moe-expert-capacity-factor 1.0, dropping by probability), dense (--num-experts 0
--ffn-hidden-size k × the expert width: the same GEMM FLOPs per token without routing, the
ceiling). Each case's MFU counts its own model FLOPs. FLOPs per token are meshlm's model FLOPs
(meshlm/flops.py ``flops_per_iteration``: the k routed experts a token uses, the router,
attention, logits; ×3 for backward) for both sides, so TFLOP/s and MFU compare like with like;
MFU against the dense bf16 peak of ``flops.PEAK_TFLOPS`` (n/a on CPU). meshlm's row also keeps
the routing figures of its last logged iteration (tokens per expert imbalance, aux loss).
One JSON row goes to --results ("bench": "moe", the learned case's figures at top level, every
case under "cases", with each case's iteration times, routing imbalance and the GPU's SM clock and
power while it ran: bench/gpu_clocks.py); the markdown table to stdout and <out>/moe_bench.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

from bench import COMMON, run_baseline
from gpu_clocks import Sampler

SHAPES = {  # preset, flags, baseline shape (the preset's numbers), micro-batch, iterations, warm-up
    "full": ("mixtral-small", ["--vocab-size", "32000", "--seq-length", "2048", "--max-position-embeddings", "2048"],
             dict(layers=16, hidden=1024, heads=16, groups=8, ffn=3584, vocab=32000, seq=2048, experts=8, topk=2,
                  aux_coeff=0.01, rope_base=1e6), 8, 14, 4),
    "tiny": ("mixtral-tiny", ["--vocab-size", "512", "--seq-length", "128", "--max-position-embeddings", "128"],
             dict(layers=2, hidden=64, heads=4, groups=2, ffn=128, vocab=512, seq=128, experts=4, topk=2,
                  aux_coeff=0.01, rope_base=1e6), 2, 4, 1),
}


def model_flops_per_token(preset: str, flags: list) -> float:
    """meshlm's model FLOPs per token (forward + backward) of ``meshlm pretrain --model preset flags``."""
    from meshlm.config import padded_vocab_size
    from meshlm.flops import flops_per_iteration
    from runs import config_of
    m = config_of(["--model", preset, *flags]).model
    return flops_per_iteration(m, 1, padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)) / m.seq_length


def case_flags(name: str, shape: dict) -> list:
    """The extra flags of one meshlm case (module doc)."""
    return {"learned": [], "balanced": ["--moe-router-force-load-balancing"],
            "capacity": ["--moe-expert-capacity-factor", "1.0"],
            "dense": ["--num-experts", "0", "--ffn-hidden-size", str(shape["topk"] * shape["ffn"])]}[name]


def run_meshlm(preset: str, flags: list, micro: int, out: str, iters: int, warmup: int, name: str = "moe",
               global_batch: int = 0) -> dict:
    """One `meshlm pretrain` process on one device; medians of its metrics.jsonl after warm-up.
    ``global_batch`` (sequences, default ``micro``): a multiple of ``micro`` accumulates gradients over
    global_batch / micro micro-batches a step (one optimizer step per global batch)."""
    run_dir = os.path.join(out, "runs", f"meshlm-{name}")
    cmd = [sys.executable, "-m", "meshlm", "pretrain", "--model", preset, *flags, *COMMON,
           "--micro-batch-size", str(micro), "--global-batch-size", str(global_batch or micro),
           "--train-iters", str(iters), "--nproc-per-node", "1", "--run-dir", run_dir]
    t0 = time.time()
    with Sampler() as clocks:
        proc = subprocess.run(cmd, env=dict(os.environ, CUDA_VISIBLE_DEVICES="0"), capture_output=True, text=True)
    with open(os.path.join(out, f"meshlm-{name}.log"), "w") as fh:
        fh.write(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    from meshlm.metrics_json import loads
    rows = [loads(line) for line in open(os.path.join(run_dir, "logs", "metrics.jsonl")) if line.strip()]
    rows = [r for r in rows if r.get("iter_ms") is not None]
    timed = rows[warmup:]
    return {"iter_ms": statistics.median(r["iter_ms"] for r in timed),
            "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in timed),
            "peak_mem_gb": max((r.get("mem_max_allocated_gb") or 0.0) for r in timed),
            "losses": [r["lm_loss"] for r in rows],
            "imbalance": (rows[-1].get("moe_tokens_per_expert") or {}).get("imbalance"),
            "dropped": rows[-1].get("moe_dropped_fraction"),
            "aux_loss": rows[-1].get("moe_aux_loss"), "wall_s": round(time.time() - t0, 1),
            "clocks": clocks.summary(),
            "iter_ms_all": [round(r["iter_ms"], 2) for r in rows],
            "imbalance_all": [round(x, 3) if (x := (r.get("moe_tokens_per_expert") or {}).get("imbalance")) else None
                              for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the CPU smoke-test shape")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results.jsonl"))
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--global-batch", type=int, default=None,
                    help="sequences a step (default: the micro-batch; a multiple accumulates gradients)")
    ap.add_argument("--iters", type=int, default=None, help="iterations a case (default: the shape's)")
    ap.add_argument("--flags", default="", help="extra meshlm flags for every case, one string (e.g. --manual-gc)")
    ap.add_argument("--cases", default="baseline,learned,balanced,capacity,dense",
                    help="comma-separated, from: baseline, learned, balanced, capacity, dense (module doc)")
    args = ap.parse_args()
    names = args.cases.split(",")
    import torch

    from meshlm.flops import peak_tflops
    preset, flags, shape, micro, iters, warmup = SHAPES["tiny" if args.tiny else "full"]
    micro = args.micro_batch or micro
    iters = args.iters or iters
    os.makedirs(args.out, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    peak = peak_tflops(gpu, torch.bfloat16)
    per_token = model_flops_per_token(preset, flags)
    base = run_baseline(shape, micro, args.out, iters, warmup) if "baseline" in names else {"error": "not run"}
    print(f"baseline: {base}", flush=True)
    cases = {}
    for name in [n for n in names if n != "baseline"]:
        extra = case_flags(name, shape)
        r = run_meshlm(preset, flags + extra + args.flags.split() + ([] if args.tiny else ["--bf16"]), micro, args.out,
                       iters, warmup, name, args.global_batch or micro)
        r["flops_per_token"] = model_flops_per_token(preset, flags + extra)
        cases[name] = r
        print(f"meshlm {name}: {r}", flush=True)

    def tflops(r, per=per_token):
        return None if "error" in r else r.get("flops_per_token", per) * r["tokens_per_sec"] / 1e12

    def mfu(r):
        return None if tflops(r) is None or not peak else round(tflops(r) / peak, 4)

    ours = cases.get("learned") or next(iter(cases.values()))
    if "error" in ours:
        raise SystemExit(f"meshlm failed: {ours['error']}")
    ok = "error" not in base
    rec = {"date": args.date, "gpu": gpu or "cpu", "gpus": 1, "bench": "moe", "case": f"{preset} ep1",
           "flags": args.flags or None,
           "model": f"{preset} L{shape['layers']} h{shape['hidden']} a{shape['heads']}/g{shape['groups']} "
                    f"{shape['experts']}x ffn{shape['ffn']} top-{shape['topk']} V{shape['vocab']}",
           "seq": shape["seq"], "micro_batch": micro, "global_batch": args.global_batch or micro,
           "flops_per_token": per_token,
           "tokens_per_sec": round(ours["tokens_per_sec"], 1), "tflops_per_gpu": round(tflops(ours), 2),
           "mfu": mfu(ours), "peak_mem_gb": round(ours["peak_mem_gb"], 2), "iter_ms": round(ours["iter_ms"], 1),
           "baseline_tokens_per_sec": round(base["tokens_per_sec"], 1) if ok else None,
           "baseline_tflops_per_gpu": round(tflops(base), 2) if ok else None, "baseline_mfu": mfu(base) if ok else None,
           "baseline_peak_mem_gb": round(base["peak_mem_gb"], 2) if ok else None,
           "baseline_error": None if ok else base["error"],
           "vs_baseline": round(ours["tokens_per_sec"] / base["tokens_per_sec"], 3) if ok else None,
           "imbalance_last": ours["imbalance"] and round(ours["imbalance"], 3), "aux_loss_last": ours["aux_loss"],
           "first_losses": [round(x, 4) for x in ours["losses"][:5]],
           "baseline_first_losses": [round(x, 4) for x in base["losses"][:5]] if ok else None,
           "cases": {n: {"tokens_per_sec": r.get("tokens_per_sec"), "iter_ms": r.get("iter_ms"),
                         "flops_per_token": r["flops_per_token"], "mfu": mfu(r), "error": r.get("error"),
                         "peak_mem_gb": r.get("peak_mem_gb"), "imbalance": r.get("imbalance"),
                         "dropped": r.get("dropped"), "first_losses": [round(x, 4) for x in r.get("losses", [])[:5]],
                         "iter_ms_all": r.get("iter_ms_all"), "imbalance_all": r.get("imbalance_all"),
                         "clocks": r.get("clocks")}
                     for n, r in cases.items()}}
    dense = cases.get("dense")
    if dense and "error" not in dense:
        rec["vs_dense"] = {n: round(r["tokens_per_sec"] / dense["tokens_per_sec"], 3)
                           for n, r in cases.items() if "error" not in r}
    print(json.dumps(rec), flush=True)
    with open(args.results, "a") as fh:
        fh.write(json.dumps(rec) + "\n")

    def fmt(x, spec):
        return "n/a" if x is None else format(x, spec)
    table = "\n".join([
        "| side | tokens/s | TFLOP/s | MFU | peak GiB | ms/iter |", "|---|---|---|---|---|---|",
        f"| plain PyTorch | {fmt(rec['baseline_tokens_per_sec'], ',.0f')} | {fmt(rec['baseline_tflops_per_gpu'], '.1f')} "
        f"| {fmt(rec['baseline_mfu'], '.3f')} | {fmt(rec['baseline_peak_mem_gb'], '.2f')} | "
        f"{fmt(base.get('iter_ms'), '.1f')} |",
        *(f"| meshlm {n} | {fmt(r.get('tokens_per_sec'), ',.0f')} | {fmt(tflops(r), '.1f')} | "
          f"{fmt(mfu(r), '.3f')} | {fmt(r.get('peak_mem_gb'), '.2f')} | {fmt(r.get('iter_ms'), '.1f')} |"
          for n, r in cases.items())])
    with open(os.path.join(args.out, "moe_bench.md"), "w") as fh:
        fh.write(f"{rec['model']}, seq {rec['seq']}, micro-batch {micro}, global batch {rec['global_batch']}, "
                 f"{rec['gpu']}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
