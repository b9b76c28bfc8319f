"""Where an MoE layer's time goes (issue 31): router, permute, grouped GEMM, unpermute and aux loss
of one mixtral-small MoE layer, each forward + backward, and the whole layer eager and compiled.

Usage (lent H200, repository root; runs against whichever meshlm is on PYTHONPATH, so the same
script profiles the code before and after a change):
    PYTHONPATH=src python bench/moe_profile.py --label after --results $OUT/results.jsonl
    PYTHONPATH=src python bench/moe_profile.py --tiny      # CPU smoke test (seconds)

Shape: T = 16,384 tokens (micro-batch 8 × sequence 2048), h 1024, 8 SwiGLU experts of 3584,
top-2 softmax, aux coefficient 1e-2, bf16 weights and activations, the router in fp32. Each stage
is timed by CUDA events around ``--iters`` calls after 3 warm-ups (median, ms), on inputs made
once: router = logits and top-k (``route``); permute = the rows in expert order
(``experts.permute``); grouped GEMM = ``Experts`` (stack of the weights, fc1, SwiGLU, fc2), also on
the slots a capacity factor of 1.0 keeps (``_dropped``: the dropped slots past the offsets), and
without the per-call stack (``_prestacked``: weights as [E, out, in] leaves; ``_kn``: stored
[E, in, out], the other operand layout); weight_stack = the two torch.stacks and their backward
alone; unpermute = the gate-weighted sum back per token over the k slots; aux loss = ``aux_loss``;
drop = ``drop`` at capacity factor 1.0; dense_mlp = the dense SwiGLU MLP of width 2 × 3584 on the
same tokens (the same GEMM FLOPs as the k = 2 experts: the ceiling of the grouped GEMM stage);
the whole ``MoELayer`` eagerly and under torch.compile (as the fast path runs it), without and
with capacity factor 1.0; optimizer_* = one step's per-parameter work over a layer's expert (and
the dense MLP's) parameter count as meshlm runs it on flat buffers: bf16 grad into the fp32
main_grad, its norm, ``torch._fused_adamw_``, fp32 → bf16 param copy (about 44 bytes a
parameter: what the dense ceiling pays on 1/4 of the MLP parameters). Backward of each stage is
driven by a fixed random gradient. One JSON row goes to --results ("bench": "moe_profile").
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
    torch.manual_seed(0)
    x = torch.randn(T, h, device=device, dtype=dtype, requires_grad=True)
    logits = layer.router(x).detach().requires_grad_()
    gates, routing_map = moe.route(logits, 2)
    gates = gates.detach().requires_grad_()
    cap = moe.capacity(T, E, 2, 1.0)
    _, kept = moe.drop(gates.detach(), routing_map, cap)

    def permute_rows(x, kept=None):
        perm, inv, expert_idx, counts, _ = dispatch.permute(routing_map, 2, kept)
        return x.index_select(0, torch.div(perm, 2, rounding_mode="floor")), perm, inv, expert_idx, counts

    rows, perm, inv, expert_idx, counts = permute_rows(x.detach())
    rows = rows.requires_grad_()
    _, _, _, kept_idx, kept_counts = permute_rows(x.detach(), kept)
    y_rows = torch.randn_like(rows).requires_grad_()
    slot_gates = gates.detach().gather(1, expert_idx.index_select(0, inv).view(T, 2)).requires_grad_()

    def unpermute(y, g):
        return (y.index_select(0, inv).view(T, 2, h).float() * g.unsqueeze(2)).sum(1).to(y.dtype)

    experts = list(layer.experts.local_experts.values())
    w1 = torch.stack([e.linear_fc1.weight.detach() for e in experts]).requires_grad_()  # [E, 2f, h]
    w2 = torch.stack([e.linear_fc2.weight.detach() for e in experts]).requires_grad_()  # [E, h, f]
    w1_kn, w2_kn = (w.detach().transpose(1, 2).contiguous().requires_grad_() for w in (w1, w2))  # [E, h, 2f], [E, f, h]
    offs = counts.cumsum(0).to(torch.int32)

    def gemm_stacked(r, a, b, transposed):  # weights already [E, ...] parameters: no per-call stack
        if not cuda:
            return r
        a, b = (a, b) if transposed else (a.transpose(1, 2), b.transpose(1, 2))
        return torch._grouped_mm(layer.experts._act(torch._grouped_mm(r, a, offs=offs)), b, offs=offs)

    def stack_only():  # the per-call torch.stack of the expert weights and its backward
        ws = [torch.stack([e.linear_fc1.weight for e in experts]), torch.stack([e.linear_fc2.weight for e in experts])]
        return sum(w.view(-1)[:1] for w in ws)

    def drop_only(g):
        return moe.drop(g, routing_map, cap)[0]

    import dataclasses
    from meshlm.model.mlp import MLP
    dense = MLP(dataclasses.replace(m, ffn_hidden_size=2 * ffn), ps, init, init, sequence_parallel=False,
                params_dtype=dtype)

    def optimizer(n):  # one step's per-parameter work over n params, as meshlm runs it (module doc)
        p16, g16 = torch.randn(n, device=device, dtype=dtype), torch.randn(n, device=device, dtype=dtype)
        p32, g32, m1, m2 = (torch.zeros(n, device=device) for _ in range(4))
        step = torch.ones((), device=device)

        def run():
            g32.copy_(g16)  # the first micro-batch's p.grad into p.main_grad
            torch._foreach_norm([g32])
            if cuda:
                torch._fused_adamw_([p32], [g32], [m1], [m2], [], [step], lr=1e-4, beta1=0.9, beta2=0.95,
                                    weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
            p16.copy_(p32)
        return run

    n_experts = sum(p.numel() for p in layer.experts.parameters())
    n_dense = sum(p.numel() for p in dense.parameters())
    x3 = x.detach().reshape(T // 8, 8, h).requires_grad_()
    compiled = torch.compile(layer)
    layer_cf = moe.MoELayer(dataclasses.replace(m, moe_expert_capacity_factor=1.0), ps, 0, init, init, moe.MoEState(),
                            sequence_parallel=False, params_dtype=dtype)
    layer_cf.train()
    compiled_cf = torch.compile(layer_cf)
    stages = {
        "router": _fwd_bwd(lambda t: moe.route(layer.router(t), 2)[0], x),
        "permute": _fwd_bwd(lambda t: permute_rows(t)[0], x),
        "grouped_gemm": _fwd_bwd(lambda r: layer.experts(r, counts, expert_idx), rows),
        "grouped_gemm_dropped": _fwd_bwd(lambda r: layer.experts(r, kept_counts, kept_idx), rows),
        "grouped_gemm_prestacked": _fwd_bwd(lambda r, a, b: gemm_stacked(r, a, b, False), rows, w1, w2),
        "grouped_gemm_prestacked_kn": _fwd_bwd(lambda r, a, b: gemm_stacked(r, a, b, True), rows, w1_kn, w2_kn),
        "weight_stack": _fwd_bwd(stack_only),
        "unpermute": _fwd_bwd(unpermute, y_rows, slot_gates),
        "aux_loss": _fwd_bwd(lambda lg: moe.aux_loss(lg, 2, "softmax", 1e-2)[0], logits),
        "drop": _fwd_bwd(drop_only, gates),
        "dense_mlp": _fwd_bwd(dense, x),
        "layer_eager": _fwd_bwd(layer, x3),
        "optimizer_expert_params": optimizer(n_experts),
        "optimizer_dense_mlp_params": optimizer(n_dense),
    }
    if cuda:  # Inductor on CPU takes minutes: the smoke test leaves the compiled layers out
        stages.update(layer_compiled=_fwd_bwd(compiled, x3), layer_compiled_capacity=_fwd_bwd(compiled_cf, x3))
    ms = {name: round(_time(fn, args.iters, device), 3) for name, fn in stages.items()}
    parts = sum(ms[k] for k in ("router", "permute", "grouped_gemm", "unpermute", "aux_loss"))
    gemm_flops = 3 * 2 * T * 2 * h * ffn * 3  # fwd+bwd, k=2 routes a token, fc1 (2·ffn) + fc2 (ffn)
    rec = {"date": args.date, "gpu": torch.cuda.get_device_name(0) if cuda else "cpu", "bench": "moe_profile",
           "label": args.label, "code": "permute", "tokens": T, "hidden": h, "experts": E,
           "ffn": ffn, "topk": 2, "dtype": str(dtype), "ms_fwd_bwd": ms, "ms_stages_sum": round(parts, 3),
           "dropped_fraction_cf1": round(1 - int(kept.sum()) / (2 * T), 4),
           "params": {"experts": n_experts, "dense_mlp": n_dense},
           "tflops": {k: round(gemm_flops / ms[k] / 1e9, 1) for k in
                      ("grouped_gemm", "grouped_gemm_prestacked", "grouped_gemm_prestacked_kn", "dense_mlp")}}
    print(json.dumps(rec), flush=True)
    if args.results:
        with open(args.results, "a") as fh:
            fh.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
