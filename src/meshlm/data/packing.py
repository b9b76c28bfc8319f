"""Documents packed into one sequence: --eod-mask-loss, --reset-position-ids, --reset-attention-mask.

Megatron's semantics (megatron-core 0.16.1, datasets/gpt_dataset.py, _get_ltor_masks_and_position_ids),
all keyed on the EOD token among a sample's input tokens (``tokens``, not ``labels``):

- eod_mask_loss: loss mask 0 where the input token is EOD;
- reset_position_ids: the position after an EOD at index i is 0 (the EOD ends its document);
- reset_attention_mask: a query never attends to a key at or before an earlier EOD: a block-diagonal
  causal mask. meshlm carries it as ``document_ids`` (the number of EODs strictly before each
  position) and builds the [s, s] mask in the model (model/attention.py ``attention_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


@dataclass(frozen=True)
class Packing:
    """The three switches and the EOD id they key on."""

    eod: int
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    @classmethod
    def of(cls, data_cfg, eod: int) -> Optional["Packing"]:
        """From Config.data; None when no switch is on (samples stay as they are)."""
        d = data_cfg
        if not (d.eod_mask_loss or d.reset_position_ids or d.reset_attention_mask):
            return None
        return cls(eod, d.eod_mask_loss, d.reset_position_ids, d.reset_attention_mask)

    def apply(self, item: dict) -> dict:
        """item {"tokens" int64 [s], "labels", "loss_mask" fp32 [s]} → the same dict, with loss
        mask 0 on EOD inputs, plus "position_ids" int64 [s] and/or "document_ids" int64 [s]."""
        tokens = item["tokens"].numpy()
        eod = tokens == self.eod
        if self.eod_mask_loss:
            item["loss_mask"] = item["loss_mask"] * torch.from_numpy(~eod)
        if self.reset_position_ids:
            item["position_ids"] = torch.from_numpy(position_ids(eod))
        if self.reset_attention_mask:
            item["document_ids"] = torch.from_numpy(np.cumsum(eod) - eod)
        return item


def position_ids(eod: np.ndarray) -> np.ndarray:
    """eod bool [s] → int64 [s]: each position minus the start of its document (the index after
    the last EOD before it, else 0)."""
    index = np.arange(eod.size, dtype=np.int64)
    starts = np.zeros(eod.size, dtype=np.int64)
    starts[1:] = np.where(eod[:-1], index[1:], 0)
    return index - np.maximum.accumulate(starts)
