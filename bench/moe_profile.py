"""Where an MoE layer's time goes (issue 31): router, permute, grouped GEMM, unpermute and aux loss
of one mixtral-small MoE layer, each forward + backward, and the whole layer eager and compiled.

Usage (lent H200, repository root; runs against whichever meshlm is on PYTHONPATH, so the same
script profiles the code before and after a change):
    PYTHONPATH=src python bench/moe_profile.py --label after --results $OUT/results.jsonl
    PYTHONPATH=src python bench/moe_profile.py --tiny      # CPU smoke test (seconds)

Shape: T = 16,384 tokens (micro-batch 8 × sequence 2048), h 1024, 8 SwiGLU experts of 3584,
top-2 softmax, aux coefficient 1e-2, bf16 weights and activations, the router in fp32. Each stage
is timed by CUDA events around ``--iters`` calls after 3 warm-ups (median, ms), on inputs made
once: router = logits and top-k (``route``), permute = the rows in expert order (``nonzero`` before
issue 31, ``experts.permute`` after), grouped GEMM = ``Experts`` (fc1, SwiGLU, fc2), unpermute =
the gate-weighted sum back per token, aux loss = ``aux_loss``; dense_mlp = the dense SwiGLU MLP of
width 2 × 3584 on the same tokens (the same GEMM FLOPs as the k = 2 experts: the ceiling of the
grouped GEMM stage, also eager); then the whole ``MoELayer`` eagerly and under torch.compile (as
the fast path runs it). Backward of each stage is driven by a
fixed random gradient. One JSON row goes to --results ("bench": "moe_profile").
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch


def _time(fn, iters: int, device) -> float:
    """Median ms of fn() (forward + backward) over iters calls after 3 warm-ups."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        import time
        out = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
        return statistics.median(out)
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def _fwd_bwd(fn, *inputs):
    """A callable running y = fn(*inputs) and y's backward with a fixed gradient."""
    grads = {}

    def run():
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.grad = None
        y = fn(*inputs)
        ys = y if isinstance(y, tuple) else (y,)
        ys = [t for t in ys if isinstance(t, torch.Tensor) and t.requires_grad]
        if ys:
            gs = [grads.setdefault(i, torch.randn_like(t)) for i, t in enumerate(ys)]
            torch.autograd.backward(ys, gs)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--label", default="after")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--results", default=None)
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    args = ap.parse_args()

    from meshlm.config import Config
    from meshlm.model import moe
    from meshlm.parallel import experts as dispatch
    from meshlm.parallel.mesh import ParallelState
    from meshlm.parallel.tensor import ShardedInit
    from meshlm.validate import validate

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    T, h, E, ffn = (16384, 1024, 8, 3584) if not args.tiny else (256, 64, 4, 128)
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 2, h, 16, 2048, 32000
    m.swiglu, m.add_bias_linear, m.normalization = True, False, "RMSNorm"
    m.num_experts, m.moe_ffn_hidden_size, m.moe_router_topk, m.moe_aux_loss_coeff = E, ffn, 2, 1e-2
    cfg.data.mock_data = True
    validate(cfg, world=1, check_files=False)
    ps = ParallelState.single(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    init = lambda name: ShardedInit((1, 0, name), 0.02, False)  # noqa: E731
    layer = moe.MoELayer(m, ps, 0, init, init, moe.MoEState(), sequence_parallel=False, params_dtype=dtype)
    layer.train()
    new = hasattr(dispatch, "permute")
    torch.manual_seed(0)
    x = torch.randn(T, h, device=device, dtype=dtype, requires_grad=True)
    logits = layer.router(x).detach().requires_grad_()
    gates, routing_map = moe.route(logits, 2)
    gates = gates.detach().requires_grad_()

    def permute_rows(x):
        if new:
            token_idx, expert_idx, counts = dispatch.permute(routing_map, T * 2)
        else:
            expert_idx, token_idx = routing_map.t().nonzero(as_tuple=True)
            counts = routing_map.sum(0)
        return x.index_select(0, token_idx), token_idx, expert_idx, counts

    rows, token_idx, expert_idx, counts = permute_rows(x.detach())
    rows = rows.requires_grad_()
    y_rows = torch.randn_like(rows).requires_grad_()

    def gemm(r):
        return layer.experts(r, counts, expert_idx) if new else layer.experts(r, counts)

    def unpermute(y, g):
        w = y.float() * g[token_idx, expert_idx].unsqueeze(1)
        return torch.zeros((T, h), dtype=torch.float32, device=device).index_add(0, token_idx, w).to(y.dtype)

    x3 = x.detach().reshape(T // 8, 8, h).requires_grad_()
    import dataclasses
    from meshlm.model.mlp import MLP
    dense = MLP(dataclasses.replace(m, ffn_hidden_size=2 * ffn), ps, init, init, sequence_parallel=False,
                params_dtype=dtype)
    compiled = torch.compile(layer)
    stages = {
        "router": _fwd_bwd(lambda t: moe.route(layer.router(t), 2)[0], x),
        "permute": _fwd_bwd(lambda t: permute_rows(t)[0], x),
        "grouped_gemm": _fwd_bwd(gemm, rows),
        "unpermute": _fwd_bwd(unpermute, y_rows, gates),
        "aux_loss": _fwd_bwd(lambda lg: moe.aux_loss(lg, 2, "softmax", 1e-2)[0], logits),
        "dense_mlp": _fwd_bwd(dense, x),
        "layer_eager": _fwd_bwd(layer, x3),
        "layer_compiled": _fwd_bwd(compiled, x3),
    }
    ms = {name: round(_time(fn, args.iters, device), 3) for name, fn in stages.items()}
    parts = sum(ms[k] for k in ("router", "permute", "grouped_gemm", "unpermute", "aux_loss"))
    gemm_flops = 3 * 2 * T * 2 * h * ffn * 3  # fwd+bwd, k=2 routes a token, fc1 (2·ffn) + fc2 (ffn)
    rec = {"date": args.date, "gpu": torch.cuda.get_device_name(0) if cuda else "cpu", "bench": "moe_profile",
           "label": args.label, "code": "permute" if new else "nonzero", "tokens": T, "hidden": h, "experts": E,
           "ffn": ffn, "topk": 2, "dtype": str(dtype), "ms_fwd_bwd": ms, "ms_stages_sum": round(parts, 3),
           "grouped_gemm_tflops": round(gemm_flops / ms["grouped_gemm"] / 1e9, 1)}
    print(json.dumps(rec), flush=True)
    if args.results:
        with open(args.results, "a") as fh:
            fh.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
