"""The optimizer step's element-wise work at mixtral-small's parameter count (issue 31): the fused
multi-tensor AdamW plus the publish copy (meshlm's default fast path before the flat update) against
optim/adamw.py's ``flat_adamw_`` (one compiled kernel a run, the publish fused), on the same flat
fp32 shards, with clipping's grad scale on.

Usage (lent GPU, repository root): PYTHONPATH=src python bench/adamw_probe.py [--params 1.53e9]
Layout: 16 layers of (8 experts × (fc1 7,340,032 + fc2 3,670,016), attention 2,097,152 + 1,048,576,
router 8,192, two norms 1,024) and two embeddings of 32,768,000, packed into 40M-element buckets in
order (no param split), as parallel/data.py does. Prints ms (median of 10 after 3 warm-ups, CUDA
events), TB/s over 28 + 6 (fused + publish) or 30 (flat) bytes an element, the number of compiles
over steps with a changing LR and step, and the largest relative difference of the masters after
one step of each from the same state.
"""

from __future__ import annotations

import statistics

import torch

from meshlm.optim.adamw import Group, Run, adamw_, flat_adamw_, flat_step


def sizes() -> list:
    """[(numel, decay)] in bucket order."""
    layer = [(1024, False)] + [(2_097_152, True), (1_048_576, True), (1024, False), (8_192, True)]
    layer += [(7_340_032, True), (3_670_016, True)] * 8
    return [(32_768_000, True)] + layer * 16 + [(1024, False), (32_768_000, True)]


def main() -> None:
    dev = torch.device("cuda")
    buckets, cur = [], []
    for n, d in sizes():
        if cur and sum(x for x, _ in cur) + n > 40_000_000:
            buckets.append(cur)
            cur = []
        cur.append((n, d))
    buckets.append(cur)
    shards = []
    for b in buckets:
        n = sum(x for x, _ in b)
        t = {k: torch.randn(n, device=dev) * 0.02 for k in ("master", "grad")}
        t["exp_avg"] = torch.randn(n, device=dev) * 1e-3
        t["exp_avg_sq"] = torch.rand(n, device=dev) * 1e-6
        t["param"] = t["master"].to(torch.bfloat16)
        frags, lo = [], 0
        for x, d in b:
            frags.append((lo, lo + x, d))
            lo += x
        shards.append((t, frags))
    total = sum(s[0]["master"].numel() for s in shards)
    print(f"{total / 1e9:.3f} B elements in {len(shards)} shards", flush=True)
    kw = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    groups = {d: Group([], [], [], [], d) for d in (True, False)}
    runs = []
    for t, frags in shards:
        for lo, hi, d in frags:
            g = groups[d]
            for lst, k in ((g.params, "master"), (g.grads, "grad"), (g.exp_avgs, "exp_avg"), (g.exp_avg_sqs, "exp_avg_sq")):
                lst.append(t[k][lo:hi])
        spans = []
        for lo, hi, d in frags:
            if spans and spans[-1][1] == lo and spans[-1][2] == d:
                spans[-1][1] = hi
            else:
                spans.append([lo, hi, d])
        runs += [Run(t["master"][lo:hi], t["grad"][lo:hi], t["exp_avg"][lo:hi], t["exp_avg_sq"][lo:hi],
                     t["param"][lo:hi], d) for lo, hi, d in spans]
    print(f"{len(runs)} runs", flush=True)
    saved = [{k: v.clone() for k, v in t.items()} for t, _ in shards]

    def fused(step=1, lr=3e-4):
        adamw_(list(groups.values()), step=step, lr=lr, fused=True, grad_scale=1.7, **kw)
        for t, _ in shards:
            t["param"].copy_(t["master"])

    kernel = torch.compile(flat_step, dynamic=True)

    def flat(step=1, lr=3e-4):
        flat_adamw_(runs, step=step, lr=lr, grad_scale=1.7, kernel=kernel, **kw)

    def restore():
        for (t, _), s in zip(shards, saved):
            for k in t:
                t[k].copy_(s[k])

    results = {}
    for name, fn in (("fused + publish", fused), ("flat", flat)):
        restore()
        fn()
        results[name] = [t["master"].clone() for t, _ in shards]
        ms = []
        for i in range(13):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(step=2 + i, lr=3e-4 * (1 + i / 7))
            b.record()
            torch.cuda.synchronize()
            ms.append(a.elapsed_time(b))
        med = statistics.median(ms[3:])
        nbytes = 34 if name.startswith("fused") else 30
        print(f"{name}: {med:.2f} ms, {total * nbytes / med / 1e9:.2f} TB/s", flush=True)
    from torch._dynamo.utils import counters
    print(f"compiles: {dict(counters['stats'])}")
    rel = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(results["fused + publish"], results["flat"]))
    print(f"max |flat - fused| / max |fused| of the masters after one step: {rel:.3e}")


if __name__ == "__main__":
    main()
