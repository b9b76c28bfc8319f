"""Plain-PyTorch baseline for bench/bench.py: a Llama or GPT-2 decoder trained by a hand-written loop, no meshlm.

What a careful PyTorch user would write (the "compiled loop" of issue 9): fp32 parameters on the
GPU with bf16 autocast, `nn.RMSNorm`, rotate-half RoPE from cached tables, GQA through SDPA
(`enable_gqa`, cuDNN/flash kernels), SwiGLU, each block under `torch.compile` (and the output
layer with its cross-entropy too), `torch.optim.AdamW(fused=True)` (no weight decay on norms),
gradient clipping at 1.0 with foreach kernels. Weights normal(0, 0.02), output projections
0.02/√(2L) (as meshlm); tokens uniform random (as meshlm's --mock-data).
--arch gpt: GPT-2 (Radford et al. 2019; nanoGPT's layout): learned positions, LayerNorm, biases,
GeLU FFN 4h, tied embeddings, multi-head attention, --dropout p on the embedding, attention
probabilities (SDPA dropout_p) and both residual branches, as meshlm's --hidden-dropout and
--attention-dropout.
--experts E --topk k: Mixtral's MoE block instead of the MLP (a plain-PyTorch MoE: router
Linear(h, E), top-k of the logits with softmax over the k, Switch load-balancing loss
--aux-coeff·E/(k·T²)·Σ P_i·f_i added to the loss, tokens sorted by expert and one SwiGLU
nn.Linear pair per expert in a loop, results scattered back with index_add); only the attention
part of each block is compiled (the expert loop has data-dependent shapes). Without CUDA it runs
on CPU, uncompiled, for a smoke test.

--fp8 tensorwise: torchao 0.18's float8 training (convert_to_float8_training) of every linear in the
blocks, before compiling (the FP8 peer of meshlm's --fp8-format; `pip install torchao`).

Usage: python bench/baseline.py [--arch gpt --dropout 0.1] [--fp8 tensorwise] --layers 16 --hidden 2048 --heads 16 --groups 8 --ffn 8192 \
           --vocab 32000 --seq 2048 --micro-batch 8 --iters 20
Prints one line `BASELINE {json}`: params, iter_ms (median after --warmup steps), tokens_per_sec,
peak_mem_gb (torch.cuda.max_memory_allocated, GiB).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm Llama block on x [b, s, h]."""

    def __init__(self, h: int, heads: int, groups: int, ffn: int, eps: float):
        super().__init__()
        self.heads, self.groups, self.d = heads, groups, h // heads
        self.norm1, self.norm2 = nn.RMSNorm(h, eps=eps), nn.RMSNorm(h, eps=eps)
        self.qkv = nn.Linear(h, (heads + 2 * groups) * self.d, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.fc1 = nn.Linear(h, 2 * ffn, bias=False)
        self.fc2 = nn.Linear(ffn, h, bias=False)

    def attend(self, x, cos, sin):
        """x + attention(norm1(x)), then norm2 of that: (residual, MLP input), both [b, s, h]."""
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split([self.heads * self.d, self.groups * self.d, self.groups * self.d], -1)
        q, k, v = (t.view(b, s, -1, self.d).transpose(1, 2) for t in (q, k, v))  # [b, n, s, d]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        return x, self.norm2(x)

    def forward(self, x, cos, sin):
        x, y = self.attend(x, cos, sin)
        gate, up = self.fc1(y).chunk(2, -1)
        return x + self.fc2(F.silu(gate) * up)


class MoEBlock(Block):
    """The Llama block with an MoE of ``experts`` SwiGLU experts (top-k) as its MLP; ``aux`` holds
    the last forward's load-balancing loss."""

    def __init__(self, h: int, heads: int, groups: int, ffn: int, eps: float, experts: int, topk: int, coeff: float):
        super().__init__(h, heads, groups, ffn, eps)
        del self.fc1, self.fc2
        self.k, self.coeff = topk, coeff
        self.router = nn.Linear(h, experts, bias=False)
        self.experts = nn.ModuleList(nn.ModuleDict({"fc1": nn.Linear(h, 2 * ffn, bias=False),
                                                    "fc2": nn.Linear(ffn, h, bias=False)}) for _ in range(experts))

    def forward(self, x, cos, sin):
        x, y = self.attend(x, cos, sin)
        shape, y = y.shape, y.reshape(-1, y.shape[-1])
        logits = self.router(y).float()
        top, idx = torch.topk(logits, self.k, dim=-1)
        gates = torch.softmax(top, dim=-1).flatten()
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        token = order // self.k
        counts = torch.bincount(flat, minlength=len(self.experts))
        T, E = y.shape[0], len(self.experts)
        self.aux = self.coeff * E / (self.k * T * T) * (torch.softmax(logits, -1).sum(0) * counts).sum()
        outs = []
        for e, rows in zip(self.experts, y[token].split(counts.tolist())):  # one host sync per layer
            gate, up = e["fc1"](rows).chunk(2, -1)
            outs.append(e["fc2"](F.silu(gate) * up))
        out = torch.cat(outs).float() * gates[order].unsqueeze(1)
        return x + torch.zeros(y.shape, device=y.device).index_add_(0, token, out).to(x.dtype).view(shape)


class GPTBlock(nn.Module):
    """Pre-norm GPT-2 block on x [b, s, h]: LayerNorm, biased linears, GeLU, dropout p."""

    def __init__(self, h: int, heads: int, ffn: int, p: float):
        super().__init__()
        self.heads, self.d, self.p = heads, h // heads, p
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, self.d).transpose(1, 2) for t in self.qkv(self.norm1(x)).chunk(3, -1))
        p = self.p if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, s, -1)), p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.norm2(x)))), p, self.training)


def rotate(x, cos, sin):
    """Rotate-half RoPE; x [b, n, s, d], cos/sin [s, d] fp32."""
    x1, x2 = x.float().chunk(2, -1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


def init_and_compile(model: nn.Module, layers: int, compile: bool = True, fp8: str | None = None) -> None:
    """Normal(0, 0.02) matrices (output projections 0.02/√(2L), as GPT-2), then (fp8: a torchao
    recipe name) the blocks' linears swapped for torchao's Float8Linear, then each block (an MoE
    block: its attention part) and the loss under torch.compile."""
    for name, p in model.named_parameters():
        if p.dim() == 2:
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
            nn.init.normal_(p, 0.0, std)
    if fp8:  # torchao float8 training: every nn.Linear of the blocks (the output head stays bf16, as meshlm's)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model.blocks, config=Float8LinearConfig.from_recipe_name(fp8))
    if not compile:
        model.loss = model._loss
        return
    for blk in model.blocks:
        if isinstance(blk, MoEBlock):
            blk.attend = torch.compile(blk.attend)
        else:
            blk.compile()
    model.loss = torch.compile(model._loss)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token loss in fp32; logits [b, s, V], labels [b, s]."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        h = a.hidden
        self.embed = nn.Embedding(a.vocab, h)
        self.blocks = nn.ModuleList((MoEBlock(h, a.heads, a.groups, a.ffn, 1e-5, a.experts, a.topk, a.aux_coeff)
                                     if a.experts else Block(h, a.heads, a.groups, a.ffn, 1e-5)) for _ in range(a.layers))
        self.norm = nn.RMSNorm(h, eps=1e-5)
        self.head = nn.Linear(h, a.vocab, bias=False)
        d = h // a.heads
        inv = 1.0 / a.rope_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = torch.outer(torch.arange(a.seq, dtype=torch.float64), inv)
        ang = torch.cat([ang, ang], -1)
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)
        init_and_compile(self, a.layers, a.compile, a.fp8)

    def _loss(self, x, labels):
        return cross_entropy(self.head(self.norm(x)), labels)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        loss = self.loss(x, labels)
        return loss + sum(blk.aux for blk in self.blocks) if self.blocks and isinstance(self.blocks[0], MoEBlock) \
            else loss


class GPT(nn.Module):
    """GPT-2: token + learned position embeddings (tied output), GPTBlocks, final LayerNorm."""

    def __init__(self, a):
        super().__init__()
        h, self.p = a.hidden, a.dropout
        self.embed, self.pos = nn.Embedding(a.vocab, h), nn.Embedding(a.seq, h)
        self.blocks = nn.ModuleList(GPTBlock(h, a.heads, a.ffn, a.dropout) for _ in range(a.layers))
        self.norm = nn.LayerNorm(h)
        init_and_compile(self, a.layers, a.compile)

    def _loss(self, x, labels):
        return cross_entropy(F.linear(self.norm(x), self.embed.weight), labels)

    def forward(self, tokens, labels):
        x = F.dropout(self.embed(tokens) + self.pos.weight[:tokens.shape[1]], self.p, self.training)
        for blk in self.blocks:
            x = blk(x)
        return self.loss(x, labels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("layers", 16), ("hidden", 2048), ("heads", 16), ("groups", 8), ("ffn", 8192),
                          ("vocab", 32000), ("seq", 2048), ("micro-batch", 8), ("iters", 20), ("warmup", 3),
                          ("experts", 0), ("topk", 2)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--aux-coeff", type=float, default=1e-2, help="MoE load-balancing coefficient")
    ap.add_argument("--rope-base", type=float, default=500000.0)
    ap.add_argument("--arch", choices=["llama", "gpt"], default="llama")
    ap.add_argument("--dropout", type=float, default=0.0, help="GPT only")
    ap.add_argument("--fp8", default=None, choices=["tensorwise", "rowwise"],
                    help="Llama only: torchao float8 training of the blocks' linears with this recipe")
    a = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64  # one cache entry per block; the default 8 falls back to eager
    torch.manual_seed(0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a.compile = dev.type == "cuda"
    model = (Llama if a.arch == "llama" else GPT)(a).to(dev)
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    params = list(model.parameters())
    times, losses = [], []
    for it in range(a.iters):
        start = time.perf_counter()  # wall time of the whole step, as meshlm's iteration time
        data = torch.randint(0, a.vocab, (a.micro_batch, a.seq + 1), device=dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # one host sync per step
        if it >= a.warmup:
            times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    n = sum(p.numel() for p in params)
    print("BASELINE " + json.dumps({
        "params": n, "iter_ms": ms, "tokens_per_sec": a.micro_batch * a.seq / (ms / 1e3),
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2 ** 30 if dev.type == "cuda" else 0.0,
        "losses": losses}), flush=True)


if __name__ == "__main__":
    main()
