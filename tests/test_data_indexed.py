"""The .bin/.idx format: our writer and reader agree with each other and with megatron-core."""

import os
import warnings

import numpy as np
import pytest
import torch

from meshlm.data.indexed import IndexedDataset, IndexedDatasetWriter, check_token_ids, token_dtype
from meshlm.errors import DataError


def random_documents(seed=0, n=50, vocab=600, max_len=40):
    """Documents of random ids, some empty (an empty document still gets an entry)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(0, max_len)) for _ in range(n)]


def write(prefix, docs, dtype=np.uint16):
    writer = IndexedDatasetWriter(prefix, dtype)
    for d in docs:
        writer.add_document(d)
    writer.finalize()


def megatron_indexed():
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    mc = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    return mc


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip_keeps_every_document_and_length(tmp_path, dtype):
    docs = random_documents()
    prefix = str(tmp_path / "ds")
    write(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs)
    assert ds.dtype == np.dtype(dtype)
    assert ds.sequence_lengths.tolist() == [len(d) for d in docs]
    assert ds.document_indices.tolist() == list(range(len(docs) + 1))
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d.tolist()
    longest = int(np.argmax([len(d) for d in docs]))
    assert ds.get(longest, 3, 5).tolist() == docs[longest][3:8].tolist()
    assert os.path.getsize(prefix + ".bin") == sum(len(d) for d in docs) * np.dtype(dtype).itemsize


def test_writer_leaves_no_final_files_before_finalize(tmp_path):
    prefix = str(tmp_path / "ds")
    writer = IndexedDatasetWriter(prefix)
    writer.add_document([1, 2, 3])
    assert not os.path.exists(prefix + ".bin") and not os.path.exists(prefix + ".idx")
    writer.finalize()
    assert os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")


def test_token_dtype_follows_megatron_threshold():
    assert token_dtype(50257) == np.uint16
    assert token_dtype(65499) == np.uint16
    assert token_dtype(65500) == np.int32
    assert token_dtype(128256) == np.int32


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_reads_our_files(tmp_path, dtype):
    mc = megatron_indexed()
    docs = random_documents(seed=1)
    prefix = str(tmp_path / "ours")
    write(prefix, docs, dtype)
    theirs = mc.IndexedDataset(prefix, multimodal=False, mmap=True)
    assert len(theirs) == len(docs)
    assert theirs.sequence_lengths.tolist() == [len(d) for d in docs]
    assert theirs.document_indices.tolist() == list(range(len(docs) + 1))
    for i, d in enumerate(docs):
        assert theirs[i].tolist() == d.tolist()


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_we_read_megatron_files(tmp_path, dtype):
    mc = megatron_indexed()
    docs = random_documents(seed=2)
    prefix = str(tmp_path / "theirs")
    builder = mc.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        builder.add_item(torch.tensor(d.astype(np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    ours = IndexedDataset(prefix)
    assert ours.dtype == np.dtype(dtype)
    assert ours.sequence_lengths.tolist() == [len(d) for d in docs]
    assert ours.document_indices.tolist() == list(range(len(docs) + 1))
    for i, d in enumerate(docs):
        assert ours[i].tolist() == d.tolist()


def test_missing_and_truncated_files_raise_data_error(tmp_path):
    with pytest.raises(DataError, match="nothing.idx does not exist"):
        IndexedDataset(str(tmp_path / "nothing"))
    prefix = str(tmp_path / "ds")
    write(prefix, [[1, 2, 3], [4, 5, 6, 7]])
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(6)
    with pytest.raises(DataError, match=r"ds.bin is truncated"):
        IndexedDataset(prefix)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"not an index at all, clearly")
    with pytest.raises(DataError, match="bad magic"):
        IndexedDataset(prefix)


def test_check_token_ids_names_the_file_and_the_largest_id(tmp_path):
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    write(good, [[0, 5, 99]])
    write(bad, [[1, 2], [300, 7], [150]])
    check_token_ids([good], vocab_size=100)
    with pytest.raises(DataError) as err:
        check_token_ids([good, bad], vocab_size=100)
    assert "bad.bin" in str(err.value) and "300" in str(err.value)
    # a tokenizer file fixes the vocabulary: --vocab-size (ignored by it) is no fix to name
    assert str(err.value).endswith("use the tokenizer the data was preprocessed with")
    with pytest.raises(DataError, match=r"preprocessed with \(or --vocab-size 301 or more\)$"):
        check_token_ids([bad], vocab_size=100, sized_by_flag=True)  # TikTokenizer's vocabulary is --vocab-size's


def test_a_bin_is_scanned_once_and_scanned_again_when_it_changes(tmp_path):
    """check_token_ids reads every id of every .bin (a terabyte corpus: minutes, on every start): the
    range is kept in the index cache, keyed by the file's path, size and modification time."""
    import json
    import os
    prefix, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    write(prefix, [[1, 2], [3, 99]])
    check_token_ids([prefix], vocab_size=100, cache_dir=cache)
    (record,) = os.listdir(cache)
    with open(os.path.join(cache, record)) as fh:
        assert json.load(fh)["max"] == 99
    with open(os.path.join(cache, record), "w") as fh:  # the next start reads the record, not the file
        json.dump({"min": 0, "max": 5000}, fh)
    with pytest.raises(DataError, match="holds token id 5000"):
        check_token_ids([prefix], vocab_size=100, cache_dir=cache)
    write(prefix, [[1, 2], [300]])  # rewritten: another size, another key, scanned again
    with pytest.raises(DataError, match="holds token id 300"):
        check_token_ids([prefix], vocab_size=100, cache_dir=cache)
    assert len(os.listdir(cache)) == 2
    os.chmod(cache, 0o500)  # a cache that cannot be written keeps no record, and the check still runs
    try:
        write(prefix, [[5]])
        check_token_ids([prefix], vocab_size=100, cache_dir=cache)
    finally:
        os.chmod(cache, 0o700)


def _corrupt(prefix, how):
    """Damage a good two-document dataset (3 + 4 uint16 tokens) the way ``how`` names."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    body = open(idx, "rb").read()
    if how == "both files empty":
        open(idx, "wb").close()
        open(bin_, "wb").close()
    elif how == "idx empty":
        open(idx, "wb").close()
    elif how == "idx header cut":
        open(idx, "wb").write(body[:20])
    elif how == "idx arrays cut":
        open(idx, "wb").write(body[:-5])
    elif how == "idx extra bytes":
        open(idx, "ab").write(b"\0" * 8)
    elif how == "wrong magic":
        open(idx, "wb").write(b"XXIDIDX\0\0" + body[9:])
    elif how == "unknown dtype code":
        open(idx, "wb").write(body[:17] + bytes([42]) + body[18:])
    elif how == "document index out of order":
        open(idx, "wb").write(body[:-24] + np.array([0, 2, 1], np.int64).tobytes())
    elif how == "bin empty":
        open(bin_, "wb").close()
    elif how == "bin longer than idx says":
        open(bin_, "ab").write(b"\0\0")
    elif how == "bin truncated":
        open(bin_, "r+b").truncate(6)


@pytest.mark.parametrize("how, bad_file", [
    ("both files empty", "idx"), ("idx empty", "idx"), ("idx header cut", "idx"), ("idx arrays cut", "idx"),
    ("idx extra bytes", "idx"), ("wrong magic", "idx"), ("unknown dtype code", "idx"),
    ("document index out of order", "idx"), ("bin empty", "bin"), ("bin longer than idx says", "bin"),
    ("bin truncated", "bin")])
def test_any_malformed_file_is_a_one_line_data_error_naming_it(tmp_path, how, bad_file):
    prefix = str(tmp_path / "e_text_document")
    write(prefix, [[1, 2, 3], [4, 5, 6, 7]])
    IndexedDataset(prefix)  # intact: opens
    _corrupt(prefix, how)
    with pytest.raises(DataError) as err:
        IndexedDataset(prefix)
    msg = str(err.value)
    assert f"e_text_document.{bad_file} " in msg and "\n" not in msg
    assert "not a valid Megatron indexed dataset" in msg and "meshlm preprocess" in msg


def test_a_dataset_of_empty_documents_with_an_empty_bin_still_opens(tmp_path):
    prefix = str(tmp_path / "ds")
    write(prefix, [[], []])
    assert os.path.getsize(prefix + ".bin") == 0
    ds = IndexedDataset(prefix)
    assert len(ds) == 2 and ds.num_tokens == 0


def test_check_token_ids_refuses_a_negative_id(tmp_path):
    """An int32 .bin holding -1 (a pad or ignore label written by another tool) trained silently:
    the vocabulary-parallel embedding gives an id outside its rows a zero vector."""
    prefix = str(tmp_path / "neg")
    write(prefix, [[1, 2, 3], [4, -1, 5]], np.int32)
    with pytest.raises(DataError, match=r"neg.bin holds token id -1, a negative id"):
        check_token_ids([prefix], vocab_size=100)


def test_check_token_ids_refuses_a_dtype_too_small_for_the_tokenizer_file(tmp_path):
    """uint16 data (a GPT-2 preprocessing) under a 128,256-id tokenizer file: every id is in range, so
    it trained on another tokenizer's ids without a word; preprocessing with that file writes int32.
    --vocab-size sizes NullTokenizer's vocabulary, which may exceed the data's."""
    prefix = str(tmp_path / "gpt2")
    write(prefix, [[1, 2, 50256]], np.uint16)
    with pytest.raises(DataError, match=r"gpt2.bin stores token ids as uint16 \(at most 65,535\) but the tokenizer "
                                        r"has 128,256 ids: the data was made by another tokenizer"):
        check_token_ids([prefix], vocab_size=128256)
    check_token_ids([prefix], vocab_size=65536)
    check_token_ids([prefix], vocab_size=128256, null_tokenizer=True)


def _ranges_by_two(rank, world, prefix, cache):
    """token_ranges over 2 ranks, with 16-byte scan pieces (8 uint16 ids) so that each rank reads some."""
    from meshlm.data import indexed
    from meshlm.parallel.mesh import ParallelState
    from meshlm.training.trainer import token_ranges
    indexed.SCAN_CHUNK_BYTES = 16
    ps = ParallelState.build()
    seen = []
    scan = indexed.scan_range
    indexed.scan_range = lambda ds, part=0, parts=1: seen.append((part, parts)) or scan(ds, part, parts)
    first = token_ranges([prefix], cache, ps)
    second = token_ranges([prefix], cache, ps)  # recorded by rank 0: nobody scans again
    return first[prefix], second[prefix], seen


def test_the_ranks_scan_a_bin_together_and_rank_0_records_the_range(tmp_path):
    """A first start scans each .bin with every rank reading an interleaved share (rank 0 alone read
    a terabyte corpus while the others waited in a collective, past its 10-minute timeout)."""
    from distributed import run_distributed
    prefix, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    ids = list(range(40))
    ids[3], ids[12] = 7000, 0  # the largest id lies in rank 0's first piece, the next ones in both
    write(prefix, [ids[:20], ids[20:]])
    results = run_distributed(_ranges_by_two, 2, prefix, cache)
    for rank, (first, second, seen) in enumerate(results):
        assert first == second == (0, 7000)
        assert seen == [(rank, 2)]  # each rank its share, once
    assert scan_all(prefix) == (0, 7000)


def scan_all(prefix):
    from meshlm.data.indexed import scan_range
    return scan_range(IndexedDataset(prefix))
