"""The pretraining sampler: global batches independent of the DP layout, exact resumption."""

import itertools
import os

import numpy as np
import torch

from distributed import run_distributed
from meshlm.config import Config
from meshlm.data.gpt_dataset import MockGPTDataset, build_datasets
from meshlm.data.indexed import IndexedDatasetWriter
from meshlm.data.sampler import micro_batches

SEQ, VOCAB = 8, 64


class Numbered:
    """Sample i has tokens all equal to i: batches show which samples they hold."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        t = torch.full((SEQ,), i, dtype=torch.int64)
        return {"tokens": t, "labels": t + 1, "loss_mask": torch.ones(SEQ)}


def global_batches(dataset, global_batch, micro, dp, consumed=0, steps=3):
    """Per step, the sorted sample ids of all DP ranks' micro-batches (global // (micro·dp) each)."""
    per_rank = global_batch // (micro * dp)
    iters = [micro_batches(dataset, consumed, micro, r, dp) for r in range(dp)]
    out = []
    for _ in range(steps):
        ids = []
        for it in iters:
            for batch in itertools.islice(it, per_rank):
                assert batch["tokens"].shape == (micro, SEQ) and batch["tokens"].dtype == torch.int64
                assert batch["loss_mask"].dtype == torch.float32
                ids += batch["tokens"][:, 0].tolist()
        out.append(sorted(ids))
    return out


def test_global_batch_is_the_same_for_every_layout():
    data = Numbered(200)
    reference = global_batches(data, 8, micro=8, dp=1)
    assert reference == [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    for micro, dp in [(4, 1), (2, 2), (1, 4), (4, 2), (1, 8), (2, 4)]:
        assert global_batches(data, 8, micro, dp) == reference, (micro, dp)


def test_rank_takes_its_slice_of_each_block():
    batches = list(itertools.islice(micro_batches(Numbered(100), 0, 2, 1, 3), 2))
    assert [b["tokens"][:, 0].tolist() for b in batches] == [[2, 3], [8, 9]]


def test_resuming_from_consumed_samples_continues_exactly():
    data = MockGPTDataset(100, SEQ, VOCAB, seed=3)
    full = global_batches(data, 8, micro=2, dp=2, steps=4)
    resumed = global_batches(data, 8, micro=4, dp=1, consumed=16, steps=2)
    assert resumed == full[2:]


def test_iteration_stops_before_an_incomplete_block():
    batches = list(micro_batches(Numbered(10), 0, 2, 0, 2))  # blocks of 4: [0,4) [4,8); 8, 9 left over
    assert [b["tokens"][:, 0].tolist() for b in batches] == [[0, 1], [4, 5]]


def _samples_on_each_rank(rank, world, folder, prefix):
    cfg = Config()
    cfg.data.data_path, cfg.data.split, cfg.data.data_cache_path = [prefix], "90,10,0", os.path.join(folder, "cache")
    cfg.data.tokenizer_type, cfg.model.vocab_size, cfg.model.seq_length = "NullTokenizer", VOCAB, SEQ
    cfg.training.train_iters, cfg.training.micro_batch_size = 5, 2
    train, _, _ = build_datasets(cfg, world_size=world)
    batches = list(itertools.islice(micro_batches(train, 0, 2, rank, world), 5))
    return torch.cat([b["tokens"] for b in batches]).tolist()


def test_two_ranks_share_one_index_cache_and_split_each_block(tmp_path):
    prefix = str(tmp_path / "d")
    rng = np.random.default_rng(0)
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(40):
        writer.add_document(rng.integers(0, VOCAB, rng.integers(1, 30)))
    writer.finalize()
    rank0, rank1 = run_distributed(_samples_on_each_rank, 2, str(tmp_path), prefix)
    files = os.listdir(tmp_path / "cache")  # built once (by rank 0), read by both
    assert len(files) == 8 and sorted({f.split("-")[2] for f in files}) == ["train", "valid"]
    cfg = Config()
    cfg.data.data_path, cfg.data.split, cfg.data.data_cache_path = [prefix], "90,10,0", str(tmp_path / "cache")
    cfg.data.tokenizer_type, cfg.model.vocab_size, cfg.model.seq_length = "NullTokenizer", VOCAB, SEQ
    cfg.training.train_iters, cfg.training.micro_batch_size = 5, 2
    single, _, _ = build_datasets(cfg, world_size=2)
    assert single.cache_hit
    for step in range(5):
        expected = [single[i]["tokens"].tolist() for i in range(4 * step, 4 * step + 4)]
        assert rank0[2 * step: 2 * step + 2] + rank1[2 * step: 2 * step + 2] == expected
