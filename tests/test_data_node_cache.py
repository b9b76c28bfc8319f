"""The sample-index cache on nodes that share no file system: global rank 0 builds, then each
other node's local rank 0 builds what its own cache folder lacks, the same files; every rank reads
its node's copy. 4 gloo ranks as 2 "nodes" of 2 (local rank = rank % 2), one cache folder each."""

import os

import numpy as np

from distributed import run_distributed
from meshlm.data.gpt_dataset import GPTDataset
from test_data_gpt_dataset import SEQ, make_dataset

NODES, PER_NODE = 2, 2


def _node_builds(rank, world, prefix, caches, broken):
    """Build the train indices into this node's folder twice (the second time from the cache), then
    once more with node 1's folder ``broken`` (under a regular file: not writable by anyone)."""
    from meshlm.data.indexed import IndexedDataset
    from meshlm.errors import DataError
    node, local, indexed = rank // PER_NODE, rank % PER_NODE, IndexedDataset(prefix)
    first = GPTDataset(indexed, "train", (0, 100), 50, SEQ, seed=3, cache_dir=caches[node], local_rank=local)
    again = GPTDataset(indexed, "train", (0, 100), 50, SEQ, seed=3, cache_dir=caches[node], local_rank=local)
    try:
        GPTDataset(indexed, "train", (0, 100), 50, SEQ, seed=3, cache_dir=[caches[0], broken][node],
                   local_rank=local)
        error = None
    except DataError as e:
        error = str(e)
    return {"hits": (first.cache_hit, again.cache_hit), "shuffle": first.shuffle_index.tolist(),
            "sample": first.sample_index.tolist(), "document": first.document_index.tolist(),
            "tokens": [first[i]["tokens"].tolist() for i in range(5)], "error": error}


def test_each_node_builds_the_same_indices_in_its_own_cache_folder_or_every_rank_fails_alike(tmp_path):
    make_dataset(tmp_path / "d")
    caches = [str(tmp_path / f"node{n}" / "cache") for n in range(NODES)]
    (tmp_path / "a_file").write_text("")
    broken = str(tmp_path / "a_file" / "cache")
    results = run_distributed(_node_builds, NODES * PER_NODE, str(tmp_path / "d"), caches, broken)
    single = GPTDataset(make_dataset(tmp_path / "d"), "train", (0, 100), 50, SEQ, seed=3,
                        cache_dir=str(tmp_path / "alone"))
    assert not single.cache_hit
    expected = sorted(os.listdir(tmp_path / "alone"))
    assert len(expected) == 4  # three indices and the description
    for cache in caches:
        assert sorted(os.listdir(cache)) == expected
        for name in expected:
            if name.endswith(".npy"):
                np.testing.assert_array_equal(np.load(os.path.join(cache, name)), np.load(tmp_path / "alone" / name))
    for r in results:
        assert r["hits"] == (False, True)
        assert r["shuffle"] == single.shuffle_index.tolist() and r["sample"] == single.sample_index.tolist()
        assert r["document"] == single.document_index.tolist()
        assert r["tokens"] == [single[i]["tokens"].tolist() for i in range(5)]
    # node 1's leader cannot write: every rank raises its one line (none waits for it in vain)
    assert {r["error"] for r in results} == {results[0]["error"]}
    assert results[0]["error"].startswith(f"--data-cache-path {broken}: cannot write the sample indices")
