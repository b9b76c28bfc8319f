"""Pipeline parity with the real GPTModel: build_model_chunks + forward_backward against one process."""

import torch
import torch.distributed as dist

from distributed import run_distributed
from meshlm.config import Config
from meshlm.parallel.mesh import ParallelState
from meshlm.parallel.pipeline import build_model_chunks, forward_backward, reduce_losses
from meshlm.parallel.tensor import gather_full_state_dict

VOCAB, STEPS = 100, 3


def _config(tp=1, pp=1, v=None, sp=False) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 4, 32, 4, 16
    m.hidden_dropout = m.attention_dropout = 0.0
    # no biases: the key bias has a zero gradient in exact arithmetic, and Adam would turn its
    # round-off noise into full-size updates that differ between layouts
    m.add_bias_linear = False
    p = cfg.parallel
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = tp, pp
    p.virtual_pipeline_model_parallel_size, p.sequence_parallel = v, sp
    cfg.training.micro_batch_size = 2
    return cfg


def _micro_batches(count: int) -> list:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(count):
        t = torch.randint(0, VOCAB, (2, 17), generator=g)
        out.append({"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(2, 16)})
    return out


def _train(cfg: Config, ps: ParallelState, m: int) -> dict:
    """STEPS AdamW steps; grads reduced by hand as DDP's finish_grad_sync would: SP params over TP,
    tied embedding copies over the embedding group, everything averaged over DP."""
    chunks = build_model_chunks(cfg, ps, VOCAB, torch.float32)
    params = [p for c in chunks for p in c.parameters()]
    # Adam divides each grad element by its own magnitude, so the ~1e-7 relative round-off of the
    # gradients grows by max|g|/(|g| + eps) on small elements (weights after 3 SGD steps agree to
    # 4e-7); eps 1e-4 (grads here are up to ~1e-2) bounds that growth below the 1e-5 tolerance
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-4)
    losses = []
    for _ in range(STEPS):
        mine = _micro_batches(m * ps.dp)[ps.dp_rank * m:(ps.dp_rank + 1) * m]
        out = forward_backward(chunks, iter(mine), ps=ps, cfg=cfg, num_microbatches=m)
        for p in params:
            if getattr(p, "sequence_parallel", False) and ps.tp_group is not None:
                dist.all_reduce(p.grad, group=ps.tp_group)
            if getattr(p, "shared_embedding", False) and ps.embedding_group is not None:
                dist.all_reduce(p.grad, group=ps.embedding_group)
            if ps.dp_group is not None:
                dist.all_reduce(p.grad, group=ps.dp_group)
                p.grad /= ps.dp
        opt.step()
        opt.zero_grad()
        losses.append(reduce_losses(out, ps))
    weights = {}
    for c in chunks:
        for name, w in gather_full_state_dict(c, ps).items():
            weights["embedding.word_embeddings.weight" if name == "output_layer.weight" else name] = w
    return {"losses": losses, "weights": weights}


def _distributed(rank, world, layout: dict, m: int) -> dict:
    ps = ParallelState.build(tp=layout.get("tp", 1), pp=layout["pp"])
    return _train(_config(**layout), ps, m)


def _assert_parity(layout: dict, world: int, m: int) -> None:
    results = run_distributed(_distributed, world, layout, m)
    dp = world // (layout.get("tp", 1) * layout["pp"])
    ref = _train(_config(), ParallelState.single(), m * dp)
    assert ref["losses"][-1] < ref["losses"][0]
    seen = set()
    for r in results:
        for got, want in zip(r["losses"], ref["losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], ref["losses"])
        for name, w in r["weights"].items():
            # relative error of the whole tensor (Frobenius norm): fp32 round-off on single small
            # elements, amplified by Adam's per-element scaling, can reach ~2e-5 of the largest
            # element while a wrong shard or gradient is off by orders of magnitude more
            rel = (w - ref["weights"][name]).norm() / ref["weights"][name].norm()
            assert rel <= 1e-5, f"{name}: relative error {rel:.2e}"
            seen.add(name)
    assert seen == set(ref["weights"])


def test_gpt_pp2_interleaved_two_virtual_stages_tied_embeddings_match_single_process():
    _assert_parity({"pp": 2, "v": 2}, world=2, m=2)


def test_gpt_pp2_tp2_dp2_sequence_parallel_matches_single_process():
    _assert_parity({"pp": 2, "tp": 2, "sp": True}, world=8, m=2)
