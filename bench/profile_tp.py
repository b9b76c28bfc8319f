"""Where does a TP step spend its time? Forward+backward of gpt2-125m at TP=1 and TP=2 under the
torch profiler, on 1 or 2 GPUs (NCCL). Prints ms per step and the top CUDA kernels / CPU ops.

Usage (on the lent machine, repository root): PYTHONPATH=src python bench/profile_tp.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshlm.config import Config
from meshlm.presets import apply_preset
from meshlm.parallel.mesh import ParallelState
from meshlm.model.chunks import build_model_chunks
from meshlm.parallel.pipeline import forward_backward

MICRO, MB, SEQ, VOCAB = 8, 4, 1024, 50257


def _batches(n, device):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        t = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g).to(device)
        yield {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(MICRO, SEQ, device=device)}


def _worker(rank, world, port, sp):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    cfg = Config()
    apply_preset(cfg, "gpt2-125m")
    cfg.model.seq_length, cfg.model.hidden_dropout, cfg.model.attention_dropout = SEQ, 0.0, 0.0
    cfg.model.vocab_size = VOCAB
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.sequence_parallel = world, sp
    cfg.training.micro_batch_size = MICRO
    ps = ParallelState.build(tp=world)
    chunks = build_model_chunks(cfg, ps, VOCAB, torch.bfloat16)

    def step():
        forward_backward(chunks, _batches(MB, ps.device), ps=ps, cfg=cfg, num_microbatches=MB)
        for p in chunks[0].parameters():
            p.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / 5 * 1e3
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    if rank == 0:
        events = prof.key_averages()
        gpu_ms = sum(e.self_device_time_total for e in events) / 1e3
        print(f"\n=== TP={world} SP={sp}: {ms:.1f} ms/step (4 micro-batches); GPU busy {gpu_ms:.1f} ms of it")
        print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=50))
        print(events.table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=50))
    dist.destroy_process_group()


def main():
    for world, sp in [(1, False), (2, False)]:
        if torch.cuda.device_count() < world:
            continue
        mp.spawn(_worker, args=(world, 29500 + world, sp), nprocs=world, join=True)


if __name__ == "__main__":
    main()
