"""The fast path (compiled layers and loss, fused AdamW) trains like the eager path, on one GPU in bf16."""

import pytest
import torch

from meshlm.config import Config
from meshlm.model.recompute import Recompute
from meshlm.model.transformer import GPTModel
from meshlm.optim.distributed import build_optimizer
from meshlm.parallel.data import DistributedDataParallel
from meshlm.parallel.mesh import ParallelState

pytestmark = pytest.mark.gpu
STEPS, VOCAB, SEQ, MICRO = 20, 1000, 128, 4


def _train(fast: bool, dropout: float = 0.0, recompute: Recompute = Recompute(), dtype=torch.bfloat16,
           steps: int = STEPS, rotary_percent: float = 1.0) -> tuple:
    """Losses of STEPS steps of a small Llama (bf16 params, fp32 masters) through the production
    DDP buffers and optimizer, and dynamo's graph count after step 3 and at the end."""
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 4, 256, 8, SEQ
    m.normalization, m.swiglu, m.position_embedding_type = "RMSNorm", True, "rope"
    m.add_bias_linear, m.untie_embeddings_and_output_weights = False, True
    m.group_query_attention, m.num_query_groups = True, 4
    m.hidden_dropout = m.attention_dropout = dropout
    m.rotary_percent = rotary_percent
    cfg.training.bf16, cfg.training.fast_path = dtype == torch.bfloat16, "on" if fast else "off"
    cfg.optimizer.lr, cfg.optimizer.lr_warmup_iters = 3e-4, 0
    ps = ParallelState.single(torch.device("cuda", 0))
    torch.cuda.manual_seed(11)  # the fast path's dropout stream, the same for every run here
    model = GPTModel(m, ps, VOCAB, seed=7, params_dtype=dtype, fast=fast, recompute=recompute)
    ddp = DistributedDataParallel([model], ps, cfg)
    opt = build_optimizer(cfg, ps, [model], ddp)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (2, MICRO, SEQ + 1), generator=gen).cuda()
    losses, graphs = [], []
    torch._dynamo.utils.counters.clear()
    for step in range(steps):
        tokens = data[step % 2]
        ddp.zero_grad()
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        loss.backward()
        ddp.finish_grad_sync()
        assert opt.step().ok
        losses.append(loss.item())
        if step in (2, steps - 1):
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return losses, graphs


@pytest.mark.parametrize("rotary_percent", [1.0, 0.25], ids=["full-rope", "partial-rope"])
def test_compiled_path_losses_match_eager_within_bf16_tolerance(rotary_percent):
    eager, _ = _train(fast=False, rotary_percent=rotary_percent)
    compiled, graphs = _train(fast=True, rotary_percent=rotary_percent)
    assert compiled[-1] < 0.9 * compiled[0], "the model must learn (two batches repeated)"
    for step, (a, b) in enumerate(zip(compiled, eager)):
        assert abs(a - b) <= 2e-2 * abs(b), (step, a, b)
    assert graphs[0] > 0 and graphs[0] == graphs[1], f"recompiled after step 3: {graphs}"


def test_fast_path_dropout_compiles_without_graph_breaks_and_replays_under_full_recompute():
    """Hidden and attention dropout 0.1 at TP=1: F.dropout and SDPA's dropout inside the compiled
    layers (no graph break), and full recompute replays the same masks (fp32: equal losses)."""
    torch._dynamo.utils.counters.clear()
    plain, _ = _train(fast=True, dropout=0.1, dtype=torch.float32, steps=5)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    recomputed, _ = _train(fast=True, dropout=0.1, dtype=torch.float32, steps=5,
                           recompute=Recompute("full", "uniform", 1))
    for a, b in zip(recomputed, plain):
        assert abs(a - b) <= 1e-5 * abs(b), (recomputed, plain)
