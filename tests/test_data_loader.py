"""--num-workers: micro-batches read ahead by worker processes are the sampler's, in its order,
also after a resume; the trainer trains the same numbers with 0 and 2 workers."""

import itertools
import os

import numpy as np
import pytest
import torch

from distributed import run_distributed
from meshlm.config import Config
from meshlm.data.gpt_dataset import build_datasets
from meshlm.data.indexed import IndexedDatasetWriter
from meshlm.data.loader import MicroBatchLoader
from meshlm.data.sampler import micro_batches
from meshlm.training import trainer

SEQ, VOCAB = 8, 64


class WhoRead:
    """GPT-like samples whose "reader" entry is the id of the process that read them."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        t = torch.full((SEQ,), i, dtype=torch.int64)
        return {"tokens": t, "labels": t + 1, "reader": torch.tensor(os.getpid())}


def gpt_train_set(tmp_path):
    """A real GPTDataset (memory-mapped .bin and index files, which the workers share)."""
    prefix = str(tmp_path / "d")
    rng = np.random.default_rng(0)
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(60):
        writer.add_document(rng.integers(0, VOCAB, rng.integers(1, 30)))
    writer.finalize()
    cfg = Config()
    cfg.data.data_path, cfg.data.data_cache_path = [prefix], str(tmp_path / "cache")
    cfg.data.tokenizer_type, cfg.model.vocab_size, cfg.model.seq_length = "NullTokenizer", VOCAB, SEQ
    cfg.training.train_iters, cfg.training.micro_batch_size = 12, 2
    return build_datasets(cfg, world_size=3)[0]


def take(iterator, n):
    return [{k: v.tolist() for k, v in b.items()} for b in itertools.islice(iterator, n)]


@pytest.mark.parametrize("workers", [0, 2])
def test_workers_read_the_samplers_batches_in_order_across_steps_and_resumes(tmp_path, workers):
    """DP rank 1 of 3, micro 2: three 'steps' of 4 micro-batches, then a resume at an earlier point,
    then a step that follows on from it: each equals micro_batches read in this process."""
    data = gpt_train_set(tmp_path)
    block = 2 * 3
    loader = MicroBatchLoader(data, 2, 1, 3, workers)

    def reference(consumed, n):
        return take(micro_batches(data, consumed, 2, 1, 3), n)

    for step in range(3):
        assert take(loader.at(step * 4 * block), 4) == reference(step * 4 * block, 4), step
    assert take(loader.at(5 * block), 3) == reference(5 * block, 3)  # a resume: restarted there
    assert take(loader.at(8 * block), 4) == reference(8 * block, 4)
    assert take(loader.at(2 * block), 2) == reference(2 * block, 2)


def test_two_workers_read_in_two_other_processes_and_zero_in_this_one():
    main = os.getpid()
    zero = take(MicroBatchLoader(WhoRead(64), 2, 0, 1, 0).at(0), 8)
    two = take(MicroBatchLoader(WhoRead(64), 2, 0, 1, 2).at(0), 8)
    assert {r for b in zero for r in b["reader"]} == {main}
    readers = {r for b in two for r in b["reader"]}
    assert len(readers) == 2 and main not in readers
    assert [b["tokens"] for b in zero] == [b["tokens"] for b in two]
    # start() forks the workers before any read (the trainer's, in build): the
    # same processes then read every micro-batch, from 0 and after a restart elsewhere
    started = MicroBatchLoader(WhoRead(64), 2, 0, 1, 2).start()
    forked = {w.pid for w in started._running._workers}
    first, later = take(started.at(0), 8), take(started.at(20), 2)
    assert [b["tokens"] for b in first] == [b["tokens"] for b in zero] and later[0]["tokens"] == [[20] * SEQ, [21] * SEQ]
    assert {r for b in first + later for r in b["reader"]} <= forked and len(forked) == 2


def test_the_loader_leaves_torchs_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    take(MicroBatchLoader(WhoRead(16), 2, 0, 1, 2).at(0), 2)
    assert torch.equal(torch.rand(3), expected)


def _config(tmp, workers, **kw):
    from test_trainer import tiny_config
    cfg = tiny_config(os.path.join(tmp, f"w{workers}"), iters=4, dropout=0.1, **kw)
    cfg.data.num_workers = workers
    return cfg


def _without_then_with_workers_and_a_resume(rank, world, tmp):
    from test_trainer import F64
    ref = trainer.pretrain(_config(tmp, 0), F64)
    first = _config(tmp, 2, exit_interval=2)
    first.checkpoint.save = os.path.join(tmp, "ckpt")
    first = trainer.pretrain(first, F64)
    resumed = _config(tmp, 2)
    resumed.checkpoint.save = resumed.checkpoint.load = os.path.join(tmp, "ckpt")
    return ref, first, trainer.pretrain(resumed, F64)


def test_training_with_two_workers_and_a_resume_repeats_the_run_with_none(tmp_path):
    """DP=2, dropout on, float64: 0 workers straight through; 2 workers stopped at iteration 2 and
    resumed from the checkpoint. Same losses bit for bit, validation included."""
    ref, first, resumed = run_distributed(_without_then_with_workers_and_a_resume, 2, str(tmp_path))[0]
    assert first["iterations"] == 2 and resumed["iterations"] == 4
    assert first["train_losses"] + resumed["train_losses"] == ref["train_losses"]
    assert resumed["last_val_loss"] == ref["last_val_loss"]
    assert ref["train_losses"][0] != ref["train_losses"][-1]
