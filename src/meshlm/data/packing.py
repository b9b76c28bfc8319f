"""Documents packed into one sequence: --eod-mask-loss, --reset-position-ids, --reset-attention-mask.

Megatron's semantics (megatron-core 0.16.1, datasets/gpt_dataset.py, _get_ltor_masks_and_position_ids),
all keyed on the EOD token among a sample's input tokens (``tokens``, not ``labels``):

- eod_mask_loss: loss mask 0 where the input token is EOD;
- reset_position_ids: the position after an EOD at index i is 0 (the EOD ends its document);
- reset_attention_mask: a query never attends to a key at or before an earlier EOD: a block-diagonal
  causal mask. meshlm carries it as ``document_ids`` (the number of EODs strictly before each
  position) and builds the [s, s] mask in the model (model/attention.py ``attention_mask``).

And, as the same function's caller (GPTDataset.__getitem__), the tokenizer's pad id (e.g.
--null-tokenizer-pad-id) when it has one other than the EOD: loss mask 0 where the label is the pad,
and the pad id read as 0 in tokens and labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


@dataclass(frozen=True)
class Packing:
    """The three switches and the EOD id they key on; pad: the id left out of the loss (-1: none)."""

    eod: int
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    pad: int = -1

    @classmethod
    def of(cls, data_cfg, eod: int, pad: int = -1) -> Optional["Packing"]:
        """From Config.data and the tokenizer's eod and pad; None when no switch is on and there is
        no pad (samples stay as they are). A pad equal to the eod is no pad (Megatron's rule: it would
        mask every document end)."""
        d = data_cfg
        pad = pad if pad >= 0 and pad != eod else -1
        if not (d.eod_mask_loss or d.reset_position_ids or d.reset_attention_mask or pad >= 0):
            return None
        return cls(eod, d.eod_mask_loss, d.reset_position_ids, d.reset_attention_mask, pad)

    def apply(self, item: dict) -> dict:
        """item {"tokens" int64 [s], "labels", "loss_mask" fp32 [s]} → the same dict, with loss
        mask 0 on EOD inputs and pad labels, pad ids replaced by 0, plus "position_ids" int64 [s]
        and/or "document_ids" int64 [s]."""
        tokens = item["tokens"].numpy()
        eod = tokens == self.eod
        if self.eod_mask_loss:
            item["loss_mask"] = item["loss_mask"] * torch.from_numpy(~eod)
        if self.reset_position_ids:
            item["position_ids"] = torch.from_numpy(position_ids(eod))
        if self.reset_attention_mask:
            item["document_ids"] = torch.from_numpy(np.cumsum(eod) - eod)
        if self.pad >= 0:
            item["loss_mask"] = item["loss_mask"] * (item["labels"] != self.pad)
            item["tokens"] = item["tokens"].masked_fill(item["tokens"] == self.pad, 0)
            item["labels"] = item["labels"].masked_fill(item["labels"] == self.pad, 0)
        return item


def position_ids(eod: np.ndarray) -> np.ndarray:
    """eod bool [s] → int64 [s]: each position minus the start of its document (the index after
    the last EOD before it, else 0)."""
    index = np.arange(eod.size, dtype=np.int64)
    starts = np.zeros(eod.size, dtype=np.int64)
    starts[1:] = np.where(eod[:-1], index[1:], 0)
    return index - np.maximum.accumulate(starts)
