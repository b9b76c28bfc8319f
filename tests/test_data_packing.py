"""Packed documents (data/packing.py): EOD loss mask, reset position ids and the block-diagonal
causal mask equal megatron-core 0.16.1's GPTDataset with the same options; the model reads them."""

import types

import numpy as np
import pytest
import torch

from meshlm.data.gpt_dataset import GPTDataset
from meshlm.data.indexed import IndexedDataset, IndexedDatasetWriter
from meshlm.data.packing import Packing
from meshlm.model.attention import attention_mask
from test_data_gpt_dataset import megatron_gpt_dataset

VOCAB, SEQ, EOD = 500, 16, 499


def make_dataset(prefix, n_docs=60, seed=0):
    """Documents of 1..12 random ids, each ending in EOD (as `meshlm preprocess --append-eod`)."""
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    for _ in range(n_docs):
        writer.add_document(np.append(rng.integers(0, VOCAB - 1, rng.integers(0, 12)), EOD))
    writer.finalize()


@pytest.mark.parametrize("mask_loss,reset_pos,reset_attn", [(True, True, True), (True, False, False),
                                                            (False, True, False), (False, False, True)])
def test_packed_samples_equal_megatron_core(tmp_path, mask_loss, reset_pos, reset_attn):
    mg, TheirIndexed, Split = megatron_gpt_dataset()
    prefix = tmp_path / "d"
    make_dataset(prefix)
    tok = types.SimpleNamespace(eod=EOD, vocab_size=VOCAB, pad=-1, unique_identifiers={"class": "t"})
    cfg = mg.GPTDatasetConfig(random_seed=3, sequence_length=SEQ, blend=([str(prefix)], None), split="1,0,0",
                              tokenizer=tok, reset_position_ids=reset_pos, reset_attention_mask=reset_attn,
                              eod_mask_loss=mask_loss, create_attention_mask=True,
                              path_to_cache=str(tmp_path / "mc"))
    theirs = mg.GPTDataset(TheirIndexed(str(prefix)), str(prefix), np.arange(60, dtype=np.int32), 40,
                           Split.train, cfg)
    packing = Packing(EOD, mask_loss, reset_pos, reset_attn)
    ours = GPTDataset(IndexedDataset(str(prefix)), "train", (0, 60), 40, SEQ, seed=3,
                      cache_dir=str(tmp_path / "c"), packing=packing)
    eods = 0
    for i in range(len(theirs)):
        a, b = ours[i], theirs[i]
        eods += int((a["tokens"] == EOD).sum())
        for key in ("tokens", "labels", "loss_mask"):
            assert a[key].tolist() == b[key].tolist(), (i, key)
        if reset_pos:
            assert a["position_ids"].tolist() == b["position_ids"].tolist(), i
        if reset_attn:
            mask = attention_mask(a["document_ids"][None])[0]  # [1, s, s], True = attend
            assert torch.equal(mask, ~b["attention_mask"]), i
        else:
            assert "document_ids" not in a
    assert eods > len(theirs), "the samples must hold several documents each"


def test_packed_documents_do_not_see_each_other():
    """A packed sample gives each document the outputs it has alone (RoPE, reset ids and mask)."""
    from meshlm.config import Config
    from meshlm.model.transformer import GPTModel
    from meshlm.parallel.mesh import ParallelState

    cfg = Config().model
    cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.seq_length = 2, 16, 4, 10
    cfg.hidden_dropout = cfg.attention_dropout = 0.0
    cfg.position_embedding_type = "rope"
    ps = ParallelState.single()
    model = GPTModel(cfg, ps, 50, seed=1).double().eval()
    a, b = torch.tensor([[5, 6, 7, EOD % 50]]), torch.tensor([[8, 9, 10, 11, 12, 13]])
    packed = torch.cat([a, b], 1)
    item = Packing(EOD % 50, True, True, True).apply({"tokens": packed[0], "labels": packed[0],
                                                     "loss_mask": torch.ones(10)})
    with torch.no_grad():
        whole = model(packed, position_ids=item["position_ids"][None], document_ids=item["document_ids"][None])
        alone = torch.cat([model(a), model(b)], 1)
    torch.testing.assert_close(whole, alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("packed", [False, True])
def test_pad_labels_are_left_out_of_the_loss_as_in_megatron_core(tmp_path, packed):
    """--null-tokenizer-pad-id 7: Megatron's GPTDataset gives labels 7 loss mask 0 and reads id 7 as 0;
    meshlm accepted the flag and trained on the pads."""
    mg, TheirIndexed, Split = megatron_gpt_dataset()
    prefix = tmp_path / "d"
    rng = np.random.default_rng(1)
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    for _ in range(60):
        doc = rng.integers(0, 20, rng.integers(1, 12))
        writer.add_document(np.append(np.where(doc < 6, 7, doc), EOD))  # a third of the ids are the pad
    writer.finalize()
    tok = types.SimpleNamespace(eod=EOD, vocab_size=VOCAB, pad=7, unique_identifiers={"class": "t"})
    cfg = mg.GPTDatasetConfig(random_seed=3, sequence_length=SEQ, blend=([str(prefix)], None), split="1,0,0",
                              tokenizer=tok, reset_position_ids=packed, reset_attention_mask=False,
                              eod_mask_loss=packed, path_to_cache=str(tmp_path / "mc"))
    theirs = mg.GPTDataset(TheirIndexed(str(prefix)), str(prefix), np.arange(60, dtype=np.int32), 30,
                           Split.train, cfg)
    data_cfg = types.SimpleNamespace(eod_mask_loss=packed, reset_position_ids=packed, reset_attention_mask=False)
    ours = GPTDataset(IndexedDataset(str(prefix)), "train", (0, 60), 30, SEQ, seed=3, cache_dir=str(tmp_path / "c"),
                      packing=Packing.of(data_cfg, EOD, pad=7))
    for i in range(len(theirs)):
        # megatron-core 0.16.1 caches the unpacked loss mask, then masks the pads in it in place: every
        # later sample inherits the pads of the first one read. Compare with the mask built afresh.
        theirs.masks_and_position_ids_are_cached = False
        a, b = ours[i], theirs[i]
        for key in ("tokens", "labels", "loss_mask") + (("position_ids",) if packed else ()):
            assert a[key].tolist() == b[key].tolist(), (i, key)
    assert Packing.of(data_cfg, EOD, pad=EOD) == (Packing(EOD, True, True) if packed else None)  # pad = eod: none
