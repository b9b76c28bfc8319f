"""Mixture-of-experts MLP (Megatron-core's MoELayer): router, routed experts, optional shared expert.

Per layer, on this rank's tokens x [s, b, h] ([s/tp, b, h] under sequence parallelism, which MoE
needs at TP > 1; [s/cp, b, h] under context parallelism; each rank routes its own rows; the
ranks that split one micro-batch's tokens — TP under SP, times CP — are the *token group*,
``ParallelState.tp_cp_group``):
  logits = x W_rᵀ [T, E] (fp32 at least), router z-loss (attached to the gates,
  ``MoELayer._attach_and_record``; this rank's mean over the token group's size: the shares add up to the
  micro-batch's mean);
  scores and top-k (``route``; Megatron's topk_routing_with_score_function): softmax over the k
  chosen logits, or over all E first with --moe-router-pre-softmax (not renormalised); sigmoid,
  normalised over the k chosen. The expert bias (aux-loss-free balancing; sigmoid scores, as in
  Megatron) shifts only the choice; the gates come from the unbiased scores.
  capacity (--moe-expert-capacity-factor): ceil(T·k/E · cf) routes per expert on this rank and
  micro-batch (T local, as in Megatron: what is dropped depends on the SP/CP split), extra
  routes dropped by lowest probability or latest position (``drop``);
  load-balancing loss (``aux_loss``, the routes counted over the token group) attached to the gates;
  dispatch to the experts (EP all-to-all, parallel/experts.py), expert MLPs, gate-weighted sum;
  plus the shared expert's output (a TP-split MLP on every token).

Auxiliary losses enter backward through ``AttachLoss``: the forward value is unchanged, backward
feeds the loss a gradient of ``MoEState.scale`` (read at backward), which the pipeline sets to what it multiplies
the LM loss by (loss_scale · CP / micro-batches; under --calculate-per-token-loss
loss_scale · DP · CP / N, the loss then weighted by the micro-batch's tokens, T times the token
group's size), so aux and LM gradients are averaged alike (Megatron's MoEAuxLossAutoScaler):
each rank's aux and z-loss are its shares of the micro-batch's, whose gradients sum over TP
(``sequence_parallel`` params) and are averaged over DP × CP, which the factor CP undoes.

Compiled (the fast path), a layer is one graph at EP = 1: the scale reaches ``AttachLoss`` as a
tensor (``MoEState.scale_tensor``, the value set copied in place), the routing statistics are
in-place updates of each layer's device buffers (``MoELayer._record``; summed, read and zeroed by
``start_routing_stats``, never read by the host in the step), and full recompute
(re-running the forward inside backward) multiplies them by 0 (``forward_pass``) rather than
skipping them, so forward and recompute run the same graph and save the same tensors. What still
breaks it: the token group's all-reduce of the aux loss's counts (TP under SP, or CP > 1:
``_summed``) and, at EP > 1, the all-to-all's host read of the counts (parallel/experts.py).

Experts are meshlm MLPs at TP = 1 (expert TP 1), named by their **global** index
(``mlp.experts.local_experts.<e>.linear_fc1.weight``), so checkpoints are layout-free; each EP
rank holds experts [r·E/EP, (r+1)·E/EP). Their params carry ``expert = True`` (reduced over the
expert-data-parallel group: parallel/data.py) and, under SP, ``sequence_parallel = True`` (TP
ranks saw different tokens: their grads are summed over TP).

The grouped GEMMs take each projection's weights stacked, [E_local, out, in]. parallel/data.py
puts every *stack* (``Experts.stacks``: one param of each local expert, ascending) back to back in
its param buffer and names those stacks in ``Experts.views``; those are then a view of the buffer
(``StackedView``: no copy, nothing saved for backward but the params' own storage), the others
(ZeRO-3's per-bucket storage, --fp8-param-gather's FP8 buffers, a layer outside any DDP) a
``torch.stack`` copy each call. Both give the params the same gradients (the stacked gradient's
slices).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import gelu_tanh, moe_ffn
from ..dtypes import HALF, wide
from ..fast import eager
from ..parallel import watchdog
from ..parallel.comm import group_size
from ..parallel.experts import dispatch_combine
from ..parallel.fp8_experts import fp8_expert_linear
from .mlp import MLP
from .router_gemm import router_logits
from .swiglu import swiglu


class MoEState:
    """What the MoE layers of one model chunk share, read by compiled layers without a graph break
    (module doc, "Compiled"): ``scale``, the aux-loss gradients' factor, set by the pipeline per
    step: a float, or a 0-dim tensor under --calculate-per-token-loss (``per_token``); setting it
    copies its value in place into ``scale_tensor`` (float64 0-dim on ``device``), the tensor
    backward reads. ``recording`` (float64 0-dim, 1 or 0): the factor of the layers' statistics
    updates (0 while full recompute re-runs the forward: ``forward_pass``)."""

    def __init__(self, device=None):
        self.device = torch.device("cpu" if device is None else device)
        self.scale_tensor = torch.ones((), dtype=torch.float64, device=self.device)
        self.recording = torch.ones((), dtype=torch.float64, device=self.device)
        self.per_token, self._scale = False, 1.0

    @property
    def scale(self):
        return self._scale

    @scale.setter
    def scale(self, value) -> None:
        self._scale, self.per_token = value, isinstance(value, torch.Tensor)
        with torch.no_grad():  # a device-side copy or fill: no host sync
            if self.per_token:
                self.scale_tensor.copy_(value)
            else:
                self.scale_tensor.fill_(value)


class AttachLoss(torch.autograd.Function):
    """y = x; backward also gives ``loss`` (0-dim) the gradient ``scale`` (a 0-dim tensor read at
    backward: ``MoEState.scale_tensor``, in the loss's dtype; see module doc)."""

    @staticmethod
    def forward(ctx, x, loss, scale):
        ctx.save_for_backward(loss, scale)
        return x

    @staticmethod
    def backward(ctx, dy):
        loss, scale = ctx.saved_tensors
        return dy, torch.ones_like(loss) * scale.to(loss.dtype), None


class StackedView(torch.autograd.Function):
    """[n, *shape] view of n params of one shape stored back to back, ascending, in one storage
    (contiguous, the i-th at the first's storage offset + i · numel; the caller guarantees it:
    ``Experts.views``): what ``torch.stack(params)`` computes, without the copy. Backward gives
    each param its slice of the stacked gradient, as stack's backward does (``unbind``).
    The view starts at the first param's own storage offset, so one compiled graph serves every
    layer (Inductor reinterprets the first param's storage: no kernel)."""

    @staticmethod
    def forward(ctx, *params):
        p = params[0]
        return p.as_strided((len(params), *p.shape), (p.numel(), *p.stride()))

    @staticmethod
    def backward(ctx, grad):
        return grad.unbind(0)


def _in_backward() -> bool:
    """True while autograd runs a backward (full recompute re-running a forward)."""
    return torch._C._current_graph_task_id() != -1


@contextlib.contextmanager
def forward_pass(state: MoEState):
    """Run the MoE layers of ``state`` within (model/transformer.py's _run_layers): if autograd is
    running a backward — full recompute re-running the forward, whose statistics must not count
    twice — ``state.recording`` is 0 inside. Read here, eagerly; the layers multiply their
    statistics by the tensor, so the recompute runs the same compiled graph (one that skipped
    the update would save other tensors for backward, which checkpoint refuses)."""
    replay = _in_backward()
    if replay:
        state.recording.fill_(0.0)
    try:
        yield
    finally:
        if replay:
            state.recording.fill_(1.0)


def route(logits: torch.Tensor, k: int, score_function: str = "softmax", pre_softmax: bool = False,
          bias: torch.Tensor | None = None) -> tuple:
    """(gates [T, E] zero except the chosen, routing_map [T, E] bool) for logits [T, E].

    Megatron's topk_routing_with_score_function (no groups, no scaling factor): see module doc.
    bias [E] (expert bias) is used with sigmoid scores only, as there (validate requires sigmoid)."""
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            top, idx = torch.topk(scores, k, dim=1)
        else:
            top, idx = torch.topk(logits, k, dim=1)
            top = torch.softmax(top, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        _, idx = torch.topk(scores if bias is None else scores + bias, k, dim=1)
        top = scores.gather(1, idx)
        if k > 1:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    gates = torch.zeros_like(logits).scatter(1, idx, top)
    return gates, torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)


def capacity(tokens: int, experts: int, k: int, factor: float) -> int:
    """Routes an expert may take: ceil(tokens · k / experts · factor) (Megatron's get_capacity)."""
    return math.ceil(tokens * k / experts * factor)


def drop(gates: torch.Tensor, routing_map: torch.Tensor, cap: int, policy: str = "probs") -> tuple:
    """(gates, routing_map) with at most ``cap`` routes per expert: the highest gates (probs) or
    the earliest tokens (position); the others' gates zeroed."""
    if cap >= gates.shape[0]:
        return gates, routing_map
    if policy == "probs":
        keep_idx = torch.topk(gates, cap, dim=0).indices
        keep = torch.zeros_like(routing_map).scatter(0, keep_idx, True) & routing_map
    else:
        keep = routing_map & (routing_map.long().cumsum(0) <= cap)
    return gates * keep, keep


def aux_coeff(cfg) -> float:
    """The load-balancing loss coefficient in effect: --moe-aux-loss-coeff, or 0 under
    --moe-router-load-balancing-type none (Megatron applies no aux loss then)."""
    return cfg.moe_aux_loss_coeff if cfg.moe_router_load_balancing_type == "aux_loss" else 0.0


def aux_loss(logits: torch.Tensor, k: int, score_function: str, coeff: float, group=None,
             counts: torch.Tensor | None = None) -> tuple:
    """(loss, tokens per expert [E]) of Switch/GShard balancing: coeff · E/(k·T²) · Σ_i P_i · f_i, with
    P_i the summed scores of this rank's rows and f_i the routes of the top-k of those scores
    counted over every rank of ``group`` (the token group: TP under SP × CP, which split the
    micro-batch's T tokens evenly; one all-reduce, run eagerly under torch.compile), so summing the ranks' losses gives the loss of
    the whole micro-batch (Megatron's switch_load_balancing_loss_func on
    compute_routing_scores_for_aux_loss, counts reduced over its tp_cp group). logits [T_local, E].
    counts: [E] this rank's routes per expert by the same top-k when the caller has them (the
    router's routing map summed: the top-k of the logits picks the top-k of their softmax, and of
    their normalised sigmoid when no expert bias moves it), else None to take the top-k here."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    if counts is None:
        counts = torch.zeros_like(scores).scatter(1, torch.topk(scores, k, dim=1).indices, 1.0).sum(0)
    else:
        counts = counts.to(scores.dtype)
    tokens = logits.shape[0]
    if group is not None:
        counts = _summed(counts, group)
        tokens *= dist.get_world_size(group)
    E = logits.shape[1]
    return (scores.sum(0) * counts).sum() * (E * coeff / (k * tokens * tokens)), counts


@eager
def _summed(counts: torch.Tensor, group) -> torch.Tensor:
    """counts summed over ``group`` (in place)."""
    dist.all_reduce(counts, group=group)
    return counts


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """coeff · mean_t (logsumexp_j logits_tj)² (ST-MoE, Zoph et al. 2022, eq. 5)."""
    return coeff * torch.logsumexp(logits, dim=-1).square().mean()


class Router(nn.Module):
    """weight [E, h]: logits of this rank's tokens; ``expert_bias`` [E] fp32 buffer (aux-loss-free;
    persistent: checkpoints hold it, one global tensor per layer, the same on every rank) and
    ``tokens_per_expert`` [E], the routes counted this step for its update (zero between steps)."""

    def __init__(self, cfg, ps, init, *, sequence_parallel: bool, params_dtype):
        super().__init__()
        E = cfg.num_experts
        self.weight = init("mlp.router.weight").param((E, cfg.hidden_size), 0, torch.arange(E), params_dtype, ps.device)
        self.weight.sequence_parallel = sequence_parallel
        self.use_bias = cfg.moe_router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(E, device=ps.device), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(E, device=ps.device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, h] → logits [T, E] in at least fp32 (half inputs on CUDA: model/router_gemm.py)."""
        if x.is_cuda and x.dtype in HALF and self.weight.dtype == x.dtype:
            return router_logits(x, self.weight)
        dtype = wide(x.dtype)
        return F.linear(x.to(dtype), self.weight.to(dtype))


class Experts(nn.Module):
    """This EP rank's routed experts: MLPs (TP = 1) under their global indices ``local_experts.<e>``.

    ``forward(x, counts, expert_idx)``: x [N, h] rows sorted by local expert, counts [E_local]
    int64 (a device tensor, never read by the host when expert_idx is given), expert_idx [N] each
    row's local expert (EP = 1, parallel/experts.py) or None; → [N, h]. Rows past Σ counts (the
    slots the capacity dropped, expert_idx E_local) are not computed: their outputs are undefined
    (zero on the loop path), the caller masks them.
    One grouped GEMM per projection (``torch._grouped_mm`` over the counts' cumulative offsets,
    weights stacked: ``stacked``) where torch has it and ``grouped`` (CUDA, fp32/bf16/fp16); else a loop over
    the experts' row blocks (one host read of the counts), or under torch.compile, with
    expert_idx, each expert on every row, its rows kept (``torch.where``: the same products per
    row, fixed shapes, no host read; E× the FLOPs: the CPU tests' compiled path). Every expert runs, on zero rows if it got none, so each gets a gradient,
    zero when unused.
    ``fp8``: an Fp8Recipe (set by model.chunks.apply_fp8) runs both projections as grouped FP8 GEMMs,
    rowwise scaled, the weight gradient per source micro-batch block (parallel/fp8_experts.py;
    ``blocks``: the expert-major (local expert, source EP rank) row counts at EP > 1, host ints);
    the router stays out of FP8.
    ``views``: the ``stacks`` whose params lie back to back in one storage (set by parallel/data.py;
    empty: every stack a copy; module doc).
    """

    def __init__(self, cfg, ps, init, scaled_init, *, sequence_parallel: bool, params_dtype):
        super().__init__()
        E, ep = cfg.num_experts, max(1, ps.ep)
        first = ps.ep_rank * (E // ep)
        self.ids = list(range(first, first + E // ep))
        expert_cfg = dataclasses.replace(cfg, ffn_hidden_size=moe_ffn(cfg))
        expert_ps = dataclasses.replace(ps, tp=1, tp_rank=0, tp_group=None)

        def renamed(fn, e):
            return lambda name: fn(name.replace("mlp.", f"mlp.experts.local_experts.{e}.", 1))

        self.local_experts = nn.ModuleDict({
            str(e): MLP(expert_cfg, expert_ps, renamed(init, e), renamed(scaled_init, e),
                        sequence_parallel=False, params_dtype=params_dtype) for e in self.ids})
        for p in self.parameters():
            p.expert, p.sequence_parallel = True, sequence_parallel
        self.swiglu, self.gelu_approximate = cfg.swiglu, "tanh" if gelu_tanh(cfg) else "none"
        self.grouped = (hasattr(torch, "_grouped_mm") and ps.device.type == "cuda"
                        and params_dtype in (torch.float32, torch.bfloat16, torch.float16))
        self.fp8, self.token_group = None, token_group(ps, sequence_parallel)
        self.views = frozenset()

    def stacks(self) -> dict:
        """{role: [the role's param of each local expert, ascending]} for every param an expert has
        (role: its name inside the expert, e.g. ``linear_fc1.weight``): what ``stacked`` stacks."""
        experts = list(self.local_experts.values())
        return {role: [e.get_parameter(role) for e in experts] for role, _ in experts[0].named_parameters()}

    def stacked(self, linear: str, name: str) -> torch.Tensor:
        """[E_local, *shape] the local experts' ``<linear>.<name>`` params stacked: a view of their
        storage if ``views`` names the stack, else a copy (module doc)."""
        params = [getattr(getattr(e, linear), name) for e in self.local_experts.values()]
        if f"{linear}.{name}" in self.views:
            return StackedView.apply(*params)
        return torch.stack(params)

    def _act(self, y: torch.Tensor) -> torch.Tensor:
        if self.swiglu:  # both halves' gradients in one pass (model/swiglu.py)
            return swiglu(y)
        return F.gelu(y, approximate=self.gelu_approximate)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, expert_idx: torch.Tensor | None = None,
                blocks: list | None = None) -> torch.Tensor:
        experts = list(self.local_experts.values())
        if self.fp8 is not None:
            return self._fp8_forward(experts, x, counts, blocks)
        if not self.grouped and (expert_idx is None or not torch.compiler.is_compiling()):
            sizes = counts.tolist()
            rows = x.split(sizes + [x.shape[0] - sum(sizes)])  # the last: rows past the counts (dropped)
            return torch.cat([e(r) for e, r in zip(experts, rows)] + [rows[-1].new_zeros(rows[-1].shape)])
        if not self.grouped:
            y = experts[0](x)
            for j, e in enumerate(experts[1:], 1):
                y = torch.where((expert_idx == j).unsqueeze(1), e(x), y)
            return y
        offs = counts.cumsum(0).to(torch.int32)
        y = torch._grouped_mm(x, self.stacked("linear_fc1", "weight").transpose(1, 2), offs=offs)
        row_bias = None
        if experts[0].linear_fc1.bias is not None:  # rows past the offsets get none (their undefined gradients reach no bias)
            row = torch.arange(x.shape[0], device=x.device, dtype=torch.int32)
            row_expert = torch.searchsorted(offs, row, right=True).clamp(max=len(experts) - 1)
            live = (row < offs[-1]).unsqueeze(1)

            def row_bias(linear):  # [N, out] each row's expert's bias, 0 past the offsets
                return torch.where(live, self.stacked(linear, "bias")[row_expert], 0)
            y = y + row_bias("linear_fc1")
        y = torch._grouped_mm(self._act(y), self.stacked("linear_fc2", "weight").transpose(1, 2), offs=offs)
        return y if row_bias is None else y + row_bias("linear_fc2")

    def _fp8_forward(self, experts, x, counts, blocks) -> torch.Tensor:
        """forward with both projections' GEMMs in FP8 (parallel/fp8_experts.py); biases by row."""
        def linear(t, name):
            y = fp8_expert_linear(t, self.stacked(name, "weight"), counts, blocks, self.fp8, self.token_group)
            if getattr(experts[0], name).bias is None:
                return y
            return y + self.stacked(name, "bias").repeat_interleave(counts, dim=0, output_size=x.shape[0])
        return linear(self._act(linear(x, "linear_fc1")), "linear_fc2")


def token_group(ps, sequence_parallel: bool):
    """The ranks that split one micro-batch's tokens: TP under SP × CP (module doc)."""
    return ps.tp_cp_group if sequence_parallel else ps.cp_group


class MoELayer(nn.Module):
    """The MLP of an MoE layer: x [s, b, h] ([s/tp, b, h] under SP) → same shape (module doc).

    state: the chunk's MoEState; layer: the global layer index (for statistics). Its routing
    statistics since the last ``start_routing_stats`` (non-persistent buffers, updated in place
    by ``_record``, read and zeroed by ``start_routing_stats``): ``routing_counts`` float64
    [E + 2]: routes per expert after dropping, routes before dropping, calls; ``routing_losses``
    [2] (the logits' dtype): summed aux and z-loss values over their coefficients (0 when off).
    """

    def __init__(self, cfg, ps, layer: int, init, scaled_init, state: MoEState, *, sequence_parallel: bool,
                 params_dtype):
        super().__init__()
        self.cfg, self.ps, self.layer, self.state = cfg, ps, layer, state
        self.token_group = token_group(ps, sequence_parallel)
        self.split = group_size(self.token_group)
        kw = dict(sequence_parallel=sequence_parallel, params_dtype=params_dtype)
        self.router = Router(cfg, ps, init, **kw)
        self.register_buffer("routing_counts", torch.zeros(cfg.num_experts + 2, dtype=torch.float64,
                                                           device=ps.device), persistent=False)
        self.register_buffer("routing_losses", torch.zeros(2, dtype=wide(params_dtype), device=ps.device),
                             persistent=False)
        self.experts = Experts(cfg, ps, init, scaled_init, **kw)
        self.shared_experts = None
        if cfg.moe_shared_expert_intermediate_size:
            shared_cfg = dataclasses.replace(cfg, ffn_hidden_size=cfg.moe_shared_expert_intermediate_size)
            self.shared_experts = MLP(shared_cfg, ps, lambda n: init(n.replace("mlp.", "mlp.shared_experts.", 1)),
                                      lambda n: scaled_init(n.replace("mlp.", "mlp.shared_experts.", 1)), **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = self.router(tokens)
        if cfg.moe_router_force_load_balancing:  # random logits, straight-through (Megatron's RandomSTE)
            logits = logits + (torch.randn_like(logits) - logits).detach()
        training = self.training and torch.is_grad_enabled()
        z = z_loss(logits, cfg.moe_z_loss_coeff / self.split) if training and cfg.moe_z_loss_coeff else None
        bias = self.router.expert_bias if self.router.use_bias else None
        gates, routing_map = route(logits, cfg.moe_router_topk, cfg.moe_router_score_function,
                                   cfg.moe_router_pre_softmax, bias)
        chosen, routes = routing_map, routing_map.sum(0)
        if cfg.moe_expert_capacity_factor is not None:
            cap = capacity(tokens.shape[0], cfg.num_experts, cfg.moe_router_topk, cfg.moe_expert_capacity_factor)
            gates, routing_map = drop(gates, routing_map, cap, cfg.moe_token_drop_policy)
        aux = None
        if training and aux_coeff(cfg):
            same_top_k = bias is None or cfg.moe_router_score_function == "softmax"  # aux_loss's counts
            aux, _ = aux_loss(logits, cfg.moe_router_topk, cfg.moe_router_score_function, aux_coeff(cfg),
                              self.token_group, routes if same_top_k else None)
        if training:
            gates = self._attach_and_record(gates, z, aux, routes, routing_map.sum(0), tokens.shape[0])
        shared = None if self.shared_experts is None else lambda: self.shared_experts(x).reshape(-1, shape[-1])
        y, s = dispatch_combine(tokens, gates, routing_map, self.experts, self.ps.ep_group, chosen,
                                cfg.moe_router_topk, shared)  # the shared expert overlaps EP's all-to-all
        return (y if s is None else y + s).reshape(shape)

    def _attach_and_record(self, gates: torch.Tensor, z, aux, routes: torch.Tensor, kept: torch.Tensor,
                           tokens: int) -> torch.Tensor:
        """gates with the z-loss and load-balancing loss (None: off) attached (``AttachLoss``: both
        on the gates, which every route's gradient passes, so the z-loss reaches the logits as if
        attached there), and this call's statistics recorded unless a backward re-runs the forward
        (full recompute: ``forward_pass``). routes, kept: [E] routes per expert before and after
        dropping. Traced whole under torch.compile: the scale is a tensor input, the statistics
        in-place updates of device tensors (``_record``)."""
        cfg, state = self.cfg, self.state
        # 1, or under --calculate-per-token-loss the micro-batch's tokens on this DP rank (this rank's
        # T times the token group's size; Megatron's num_local_tokens · tp_cp size)
        weight = float(tokens * self.split) if state.per_token else 1.0
        if z is not None:
            gates = AttachLoss.apply(gates, z * weight, state.scale_tensor)
        if aux is not None:
            gates = AttachLoss.apply(gates, aux * weight, state.scale_tensor)
        self._record(kept, routes, aux=None if aux is None else aux / aux_coeff(cfg),
                     z=None if z is None else z * self.split / cfg.moe_z_loss_coeff)
        return gates

    def _record(self, kept: torch.Tensor, routes: torch.Tensor, aux=None, z=None) -> None:
        """Add one call's statistics, times ``MoEState.recording``, in place (no host read; traced
        by dynamo; the buffers, not the layer index, so every layer runs the same graph): kept,
        routes [E] int routes per expert after and before dropping; aux, z: 0-dim loss values
        over their coefficients, or None (off). Also the expert bias's counts."""
        on = self.state.recording
        self.routing_counts += torch.cat((kept, routes.sum().view(1), torch.ones_like(kept[:1]))) * on
        if aux is not None:
            self.routing_losses[0] += aux.detach() * on.to(aux.dtype)
        if z is not None:
            self.routing_losses[1] += z.detach() * on.to(z.dtype)
        if self.router.use_bias:
            self.router.tokens_per_expert += kept * on


def routing_stats(chunks, ps, cfg) -> dict:
    """The routing statistics the MoE layers recorded since the last call, summed over every rank
    (TP, DP × CP, PP: each rank routes its own tokens; EP ranks are DP ranks), then reset.

    Returns {layer: {"tokens": [E] routes per expert after dropping, "routes": routes before
    dropping, "aux": mean load-balancing loss per micro-batch over its coefficient (None when
    --moe-aux-loss-coeff is 0), "z": the same for the z-loss}} for the MoE layers that trained.
    Collective over all ranks: every rank calls it at the same iterations (the log iterations).
    """
    return start_routing_stats(chunks, ps, cfg)()


@torch.no_grad()
def start_routing_stats(chunks, ps, cfg):
    """``routing_stats`` in two halves: this call sums and resets the statistics (the collective)
    and starts copying them to the host; the function it returns gives ``routing_stats``'s dict.
    On CUDA the copy waits on an event recorded right after it, so called between the backward
    and the optimizer step, the host's read waits for no later work (the trainer's log
    iterations: a read after the step would drain the GPU before the next step is launched)."""
    E, L = cfg.num_experts, cfg.num_layers
    # [L, E + 4]: routes per expert, routes before dropping, calls, aux, z (the layers' buffers,
    # all on the device: made and filled there, no host number copied over)
    table = torch.zeros(L, E + 4, dtype=torch.float64, device=ps.device)
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, MoELayer):
                table[m.layer, :E + 2] += m.routing_counts
                table[m.layer, E + 2:] += m.routing_losses
                m.routing_counts.zero_()
                m.routing_losses.zero_()
    if ps.world_size > 1:
        watchdog.call("all_reduce of the MoE routing statistics", None, dist.all_reduce, table)
    shares = ps.tp * ps.cp  # MoE at TP > 1 runs under SP: each TP × CP rank records its rows' share
    host, copied = table, None
    if table.device.type == "cuda":
        host, copied = table.to("cpu", non_blocking=True), torch.cuda.Event()
        copied.record()

    def finish() -> dict:
        if copied is not None:
            copied.synchronize()
        rows, out = host.tolist(), {}
        for layer in range(L):
            routes, calls, aux, z = rows[layer][E:]
            if calls:
                out[layer] = {"tokens": rows[layer][:E], "routes": routes,
                              "aux": aux * shares / calls if aux_coeff(cfg) else None,  # shares add up
                              "z": z / calls if cfg.moe_z_loss_coeff else None}  # each rank's is a mean
        return out
    return finish


def routing_summary(stats: dict, iterations: int) -> dict:
    """Log-line figures of ``routing_stats`` over ``iterations`` steps: moe_aux_loss and
    moe_z_loss (means over the MoE layers; None when off), moe_tokens_per_expert {"min", "max"
    (routes per step, over layers and experts), "imbalance" (max / mean, averaged over the
    layers; 1 is perfectly even)}, moe_imbalance_per_layer {layer: max / mean}, and
    moe_dropped_fraction (routes dropped by the capacity over routes chosen). {} without stats."""
    if not stats:
        return {}
    def mean(key):
        values = [s[key] for s in stats.values() if s[key] is not None]
        return sum(values) / len(values) if values else None
    tokens = [t / iterations for s in stats.values() for t in s["tokens"]]
    per_layer = {layer: max(s["tokens"]) * len(s["tokens"]) / max(sum(s["tokens"]), 1e-30)
                 for layer, s in stats.items()}
    routes = sum(s["routes"] for s in stats.values())
    kept = sum(sum(s["tokens"]) for s in stats.values())
    return {"moe_aux_loss": mean("aux"), "moe_z_loss": mean("z"),
            "moe_tokens_per_expert": {"min": min(tokens), "max": max(tokens),
                                      "imbalance": sum(per_layer.values()) / len(per_layer)},
            "moe_imbalance_per_layer": per_layer,
            "moe_dropped_fraction": 1.0 - kept / routes if routes else 0.0}
