"""MoE layers and context parallelism in the planner: FLOPs, activations and communication per layer.

MoE layers (model/moe.py, parallel/experts.py: Megatron-core's MoELayer with the all-to-all token
dispatcher). T = the tokens a rank routes per micro-batch, b·s/CP (/TP under sequence parallelism,
which MoE needs at TP > 1); R = k·T their routes; E experts of width f_e, EP ranks splitting them.

- FLOPs per token, forward: the router 2·h·E and the k experts it is routed to, plus the shared
  expert, 2·h·(k·f_e + f_s)·(2 GeLU | 3 SwiGLU) (``flops.mlp_flops_per_token``); backward
  2× forward. This is Megatron-LM's ``num_floating_point_operations`` (``moe_layer_flops``: the
  ``moe_router_topk`` experts routed to and the shared expert; it leaves out the router) and the
  "active parameters" count of Jiang et al. 2024, "Mixtral of Experts", arXiv 2401.04088 (2 of 8
  experts a token: 13B of 47B parameters). EP does not divide it: each rank computes the routes sent
  to its E/EP experts, as many as its own T tokens send out when routing is balanced, which the
  planner assumes (the aux loss or the expert bias keep it near; a hot expert's rank gets more). The
  expert GEMMs run at TP 1 on R·EP/E rows per local expert, which sets their efficiency
  (``expert_rows``).
- All-to-all (GShard, Lepikhin et al. 2020, arXiv 2006.16668: AllToAll dispatch and combine; Switch
  Transformer, Fedus et al. 2021, arXiv 2101.03961): per MoE layer and micro-batch, dispatch and
  combine in forward and their gradients in backward, 4 all-to-alls; in each a rank sends
  R·h·bytes·(EP − 1)/EP (the R/EP routes of each other EP rank), plus one counts exchange (latency
  only) in forward. meshlm's all-to-alls block (experts.py), so all of them are exposed, except
  with a shared expert: the dispatch's exchange runs while the shared expert's forward does, and its
  gradient exchange while the shared expert's backward does, each hidden up to that compute
  (``ep_seconds``); full recompute repeats the forward ones. The EP group's
  ranks are TP apart inside the DP × CP ranks: min(EP, GPUs per node / TP) of them share a node and
  exchange over NVLink while the others use the NIC, at once: max(NVLink bytes / its bandwidth,
  NIC bytes / its bandwidth).
- Activations kept for backward, replacing the dense MLP's fc1 and activation outputs
  (``moe_mlp_terms``, checked against a MoELayer's saved tensors in tests/test_planner_moe_cp.py).
  ``fast`` (the GPU default: a compiled layer, one grouped GEMM a projection): the dispatched rows
  act·R·h, the experts' fc1 and activation outputs act·R·f_e·(2 | 1) + act·R·f_e (as the dense
  terms count SwiGLU), the experts' output act·R·h (the combine's fp32 cast is fused), the routing
  tensors 40·R + 8·T·E + 4·E bytes (the fixed slots' experts and order, their inverse, the gathered
  gates; the router's fp32 scores and probabilities for the top-k and the aux loss; 4·E of offsets:
  the layer is one graph, so the aux loss's counts are recomputed in backward), the router's
  fp32 copies of its input and weight 4·(T + E)·h (bf16/fp16 only), the grouped GEMM's stacked
  weights act·(E/EP)·(2 | 1 + 1)·h·f_e under ZeRO-3 only (``stacked_copy``: there model/moe.py
  ``Experts`` stacks the per-expert weights each call, a new tensor the GEMM keeps for backward;
  elsewhere the stack is a view of the DDP's param buffer, no bytes of its own), and a shared
  expert's fc1 and activation outputs as a dense MLP of width f_s. Eager (``fast=False``, the
  CPU's loop over the experts): the combine keeps an fp32 copy, 4·R·h, and the routing 56·R, no
  stacked copy. The per-layer transient of the exchange buffers is left out (freed before the
  next layer).
- No term for time outside the GEMMs that grows with the expert count: an empirical 0.85 ns · T ·
  (E/EP)² a layer (2026-12-04, fit to five runs) was refuted on unseen runs: the misses it fitted
  were host-bound steps (bench/RESULTS.md, 2026-12-04: GPU kernels 77.5 ms of a 100–175 ms E 16
  step), now the host-time model's (planner/host.py: an MoE layer's launches grow with its experts).
- Model state: a rank holds E/EP experts per MoE layer (``planner/params.py``); their gradients
  are reduced over, and under ZeRO-1 their optimizer state sharded over, the expert-data-parallel
  group of DP × CP / EP ranks (parallel/data.py, optim/distributed.py), the rest over DP × CP.

Context parallelism (parallel/context.py): every rank holds s/CP tokens of each sequence in the
zigzag split (chunks r and 2·CP−1−r of 2·CP), so all GEMM and element-wise work and every activation
is divided by CP, and so is the causal attention work, exactly: each rank attends 2c²·CP
query-key pairs (c = s/2CP) of the s²/2 in all, without masked blocks. K/V of the rank's tokens
are kv = 2·b·(s/CP)·(g/TP)·d·act bytes a layer (g query groups of head dim d).

- ``--cp-comm-type p2p`` (ring; Liu et al. 2023, "Ring Attention with Blockwise Transformers",
  arXiv 2310.01889; Megatron-Core's context_parallel feature docs): forward, kv passed on CP − 1
  times, each hop overlapped with the attention of the block already held (1/CP of the layer's
  attention forward): exposed max(0, hop − block) a hop. Backward, as meshlm's ring does it: kv
  passed CP − 1 times again, overlapped with each block's backward (twice its forward), and the
  dK/dV accumulator (fp32 at bf16) passed CP times after each block's backward, exposed (the ring
  waits for it before the next block).
- ``all_gather`` (Llama 3, arXiv 2407.21783 §3.3.2): forward all-gathers every rank's kv, backward
  gathers it again and reduce-scatters dK/dV (fp32 at bf16); blocking, all exposed.
- The CP group's ranks are TP apart: NVLink when TP × CP fits a node, else the NIC. The ring's
  spare K/V buffer and the all-gather's full-sequence K/V (one layer at a time) are left out of
  memory.
"""

from __future__ import annotations

from ..config import Config, ModelConfig, head_dim, moe_ffn, query_groups
from .gpus import COLLECTIVE_LATENCY_S as LATENCY_S, GPU

def stacked_copy(layout) -> bool:
    """Whether the grouped GEMMs stack the experts' weights by a copy each call: under ZeRO-3 with
    more than one expert-DP rank (DP × CP / EP; each bucket then has its own param storage);
    otherwise the DDP lays each stack out back to back and the GEMMs take a view (model/moe.py
    ``StackedView``, parallel/data.py)."""
    return layout.stage == 3 and layout.dp * layout.cp > layout.ep


def tokens_per_rank(m: ModelConfig, b: int, layout) -> float:
    """T: the tokens one rank routes per micro-batch, b·s/CP, /TP under sequence parallelism."""
    return b * m.seq_length / layout.cp / (layout.tp if layout.sequence_parallel else 1)


def stacked_weight_bytes(m: ModelConfig, layout, *, act_bytes: int = 2) -> float:
    """Bytes of the grouped GEMM's per-call stack of one layer's local expert weights: act·(E/EP)·(2 | 1
    + 1)·h·f_e where ``stacked_copy``, else 0 (and for a dense model)."""
    if not stacked_copy(layout) or not m.num_experts:
        return 0.0
    return act_bytes * m.num_experts / layout.ep * ((2 if m.swiglu else 1) + 1) * m.hidden_size * moe_ffn(m)


def expert_rows(m: ModelConfig, b: int, layout) -> float:
    """Rows of one local expert's GEMMs per micro-batch (balanced routing): R·EP/E."""
    return m.moe_router_topk * tokens_per_rank(m, b, layout) * layout.ep / m.num_experts


def moe_mlp_terms(m: ModelConfig, b: int, layout, *, act_bytes: int = 2, fast: bool = True) -> dict:
    """Bytes an MoE layer's MLP keeps for backward on one rank (module doc), by term, at CP 1 (the
    caller divides by CP as for the other terms): {"router", "dispatched", "expert_fc1",
    "expert_activation", "combine", "stacked_weights", "shared_fc1", "shared_activation"}.
    fast: the compiled grouped-GEMM layer (GPUs); False: the eager loop over the experts."""
    t = layout.tp
    T = b * m.seq_length / (t if layout.sequence_parallel else 1)
    R, f_e, f_s = m.moe_router_topk * T, moe_ffn(m), m.moe_shared_expert_intermediate_size or 0
    h, gates, E = m.hidden_size, 2 if m.swiglu else 1, m.num_experts
    wide_copies = 4 * (T + E) * h if act_bytes < 4 else 0  # the router's fp32 input and weight
    stacked = stacked_weight_bytes(m, layout, act_bytes=act_bytes) if fast else 0.0
    return {"router": (40 * R + 8 * T * E + 4 * E if fast else 56 * R) + wide_copies, "dispatched": act_bytes * R * h,
            "expert_fc1": act_bytes * R * f_e * gates, "expert_activation": act_bytes * R * f_e,
            "combine": (act_bytes if fast else 4) * R * h, "stacked_weights": stacked,
            "shared_fc1": act_bytes * b * m.seq_length * f_s * gates / t,
            "shared_activation": act_bytes * b * m.seq_length * f_s / t}


def _a2a_seconds(nbytes: float, layout, gpu: GPU, gpus_per_node: int) -> float:
    """One all-to-all in which every EP rank holds ``nbytes`` spread evenly over the EP ranks."""
    ep = layout.ep
    if ep <= 1:
        return 0.0
    local = min(ep, max(1, gpus_per_node // layout.tp))
    per_peer = nbytes / ep
    return max((local - 1) * per_peer / gpu.intra_node_bytes_per_s,
               (ep - local) * per_peer / gpu.inter_node_bytes_per_s) + LATENCY_S


def ep_seconds(m: ModelConfig, b: int, layout, gpu: GPU, gpus_per_node: int, *, act_bytes: int = 2,
               shared_forward_s: float = 0.0) -> tuple:
    """(forward, backward) exposed seconds of one MoE layer's all-to-alls per micro-batch (module
    doc): forward the counts exchange and 2 all-to-alls of R·h·act bytes, backward 2 more; with a
    shared expert whose forward takes ``shared_forward_s`` on the rank (its backward twice that), the
    dispatch's exchange hides behind its forward and the dispatch's gradient exchange behind its
    backward, each up to the shared expert's time."""
    if layout.ep <= 1:
        return 0.0, 0.0
    one = _a2a_seconds(m.moe_router_topk * tokens_per_rank(m, b, layout) * m.hidden_size * act_bytes,
                       layout, gpu, gpus_per_node)
    return 2 * one + LATENCY_S - min(one, shared_forward_s), 2 * one - min(one, 2 * shared_forward_s)


def kv_bytes(m: ModelConfig, b: int, layout, act_bytes: int = 2) -> float:
    """K and V of one rank's s/CP tokens in one layer: 2·b·(s/CP)·(g/TP)·d·act bytes."""
    return 2 * b * m.seq_length / layout.cp * max(1.0, query_groups(m) / layout.tp) * head_dim(m) * act_bytes


def cp_link(layout, gpu: GPU, gpus_per_node: int) -> float:
    """Bandwidth inside the CP group (ranks TP apart): NVLink when TP × CP fits a node."""
    return gpu.intra_node_bytes_per_s if layout.tp * layout.cp <= gpus_per_node else gpu.inter_node_bytes_per_s


def cp_seconds(cfg: Config, b: int, layout, gpu: GPU, gpus_per_node: int, attention_forward_s: float, *,
               act_bytes: int = 2) -> tuple:
    """(forward, backward) exposed seconds of one layer's CP communication per micro-batch (module
    doc); attention_forward_s: the layer's attention-core forward on this rank (its backward 2×)."""
    cp = layout.cp
    if cp <= 1:
        return 0.0, 0.0
    kv, link = kv_bytes(cfg.model, b, layout, act_bytes), cp_link(layout, gpu, gpus_per_node)
    grad = kv * 4 / act_bytes  # dK/dV accumulate in fp32 (at least)
    if cfg.model.cp_comm_type == "all_gather":
        gather = (cp - 1) * kv / link + LATENCY_S
        return gather, gather + (cp - 1) * grad / link + LATENCY_S
    hop, block = kv / link + LATENCY_S, attention_forward_s / cp
    forward = (cp - 1) * max(0.0, hop - block)
    return forward, (cp - 1) * max(0.0, hop - 2 * block) + cp * (grad / link + LATENCY_S)


def padded(params: float, group: int, distributed_optimizer: bool) -> float:
    """Elements of a gradient buffer of ``params`` under ZeRO-1: padded to 64 × the group it is
    sharded over (parallel/data.py; exact for one bucket a buffer, < 64 × group short per extra one)."""
    if not distributed_optimizer:
        return params
    unit = 64 * group
    return -(-params // unit) * unit
