"""The checkpoint's model space: every model tensor under one global name with its real global
shape, and where this rank's pieces of it (weights, or optimizer state) lie in it.

Names are the model's parameter names (global layer indices: the same in every layout), except:
- a fused column-parallel weight is stored as its logical tensors, which the model declares as
  ``p.fused_parts`` ((part module name, rows), … along partition_dim): ``linear_qkv`` → ``linear_q``,
  ``linear_k``, ``linear_v``; SwiGLU's ``linear_fc1`` → ``linear_fc1_gate``, ``linear_fc1_up``
  (``self.fused`` records them so ``state.full_model_state`` can fuse them back);
- the last stage's copy of a tied output weight (PP > 1) is the word embedding: it reads
  ``embedding.word_embeddings.weight`` and never writes it (the first stage does).
Shapes are the full TP=1 shapes, vocabulary unpadded.

Pieces: the local rows (columns) of a TP-split tensor (``partition_index``, parallel/tensor.py)
are cut into runs of consecutive global rows inside one logical tensor; padding rows (≥
``full_size``) belong to none. A TP-replicated tensor is one piece, the whole tensor: every rank
reads it, TP rank 0 writes it (DP replicas offer identical boxes, which DCP writes once). The
optimizer's state of a parameter (a flat range of its flattened local shape under ZeRO-1) is
first cut into boxes of the local shape (``boxes.flat_boxes``), then placed like the weight.
Every piece is a view of the live tensors: saving reads them, loading writes into them (no copy
in either direction, see boxes.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .boxes import Boxes, flat_boxes

EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"


@dataclass(frozen=True)
class Piece:
    """Box [local, local + size) of a local tensor is box [offset, offset + size) of global tensor
    ``key`` of ``shape``."""

    key: str
    shape: tuple
    offset: tuple
    local: tuple
    size: tuple


def _replace(t: tuple, dim: int, value: int) -> tuple:
    return t[:dim] + (value,) + t[dim + 1:]


def tensor_pieces(name: str, t: torch.Tensor, tp_rank: int) -> tuple:
    """(pieces, writes, fused) of the local model tensor ``name``: its Pieces in model space,
    whether this rank writes them, and {"dim", "parts": [[key, rows], …]} for a fused tensor (else
    None). See the module docstring."""
    shape = tuple(t.shape)
    zero = (0,) * len(shape)
    if name == OUTPUT and getattr(t, "shared_embedding", False):
        return tensor_pieces(EMBEDDING, t, tp_rank)[0], False, None
    if not getattr(t, "tensor_model_parallel", False):
        return [Piece(name, shape, zero, zero, shape)], tp_rank == 0, None
    dim, idx = t.partition_dim, t.partition_index.tolist()
    parts, fused = [(name, 0, t.full_size)], None
    if getattr(t, "fused_parts", None):
        prefix, leaf = name.rsplit(".", 2)[0], name.rsplit(".", 1)[1]
        starts = [0]
        for _, rows in t.fused_parts:
            starts.append(starts[-1] + rows)
        assert starts[-1] == t.full_size, f"{name}: fused parts {t.fused_parts} do not add up to {t.full_size}"
        parts = [(f"{prefix}.{part}.{leaf}", s, rows) for (part, rows), s in zip(t.fused_parts, starts)]
        fused = {"dim": dim, "parts": [[key, rows] for key, _, rows in parts]}
    pieces, j = [], 0
    while j < len(idx):
        part = next((p for p in parts if p[1] <= idx[j] < p[1] + p[2]), None)
        if part is None:  # vocabulary padding
            j += 1
            continue
        key, start, rows = part
        k = j + 1
        while k < len(idx) and idx[k] == idx[k - 1] + 1 and idx[k] < start + rows:
            k += 1
        pieces.append(Piece(key, _replace(shape, dim, rows), _replace(zero, dim, idx[j] - start),
                            _replace(zero, dim, j), _replace(shape, dim, k - j)))
        j = k
    return pieces, True, fused


def _cut(pieces: list, local: tuple, data: torch.Tensor) -> list:
    """[(key, shape, global offset, view)]: ``data``, the box of a local tensor starting at
    ``local``, intersected with each piece."""
    out = []
    for pc in pieces:
        lo = tuple(max(a, b) for a, b in zip(local, pc.local))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(local, data.shape, pc.local, pc.size))
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        view = data[tuple(slice(a - b, c - b) for a, c, b in zip(lo, hi, local))]
        out.append((pc.key, pc.shape, tuple(g + a - b for g, a, b in zip(pc.offset, lo, pc.local)), view))
    return out


def _group(items: list) -> dict:
    """{key: Boxes} of [(key, shape, offset, view)]."""
    found: dict = {}
    for key, shape, off, view in items:
        found.setdefault(key, (shape, []))[1].append((off, view))
    return {key: Boxes(shape, pieces) for key, (shape, pieces) in found.items()}


class ModelSpace:
    """Where this rank's model tensors (of every chunk's state_dict) lie in model space.

    ``fused``: {fused name: {"dim", "parts"}} of this rank's fused tensors (JSON).
    """

    def __init__(self, chunks, ps):
        self.tensors, self.where, self.fused = [], {}, {}
        tp_rank = getattr(ps, "tp_rank", 0)
        for chunk in chunks:
            for name, t in chunk.state_dict(keep_vars=True).items():
                pieces, writes, fused = tensor_pieces(name, t, tp_rank)
                self.tensors.append(t)
                self.where[t] = (pieces, writes)
                if fused:
                    self.fused[name] = fused

    def model(self, writing: bool, skip=frozenset()) -> dict:
        """{key: Boxes of views into the model tensors}: what this rank writes (writing) or reads;
        the tensors in ``skip`` left out (ZeRO-3's, placed from their shards by ``state``)."""
        items = []
        for t in self.tensors:
            pieces, writes = self.where[t]
            if t not in skip and (writes or not writing):
                items += _cut(pieces, (0,) * t.dim(), t.detach())
        return _group(items)

    def state(self, fragments: list, writing: bool) -> dict:
        """{key: {kind: Boxes}} of per-parameter state given as [(param, p_lo, {kind: [n] view})]
        (elements [p_lo, p_lo + n) of the flattened local param; optim.MixedPrecisionOptimizer.
        state_pieces)."""
        items: dict = {}
        for p, p_lo, views in fragments:
            pieces, writes = self.where[p]
            if writing and not writes:
                continue
            strides = [math.prod(p.shape[d + 1:]) for d in range(p.dim())]
            for kind, flat in views.items():
                for off, size in flat_boxes(p.shape, p_lo, p_lo + flat.numel()):
                    start = sum(o * s for o, s in zip(off, strides)) - p_lo
                    data = flat[start:start + math.prod(size)].view(size)
                    items.setdefault(kind, []).extend(_cut(pieces, off, data))
        out: dict = {}
        for kind, found in items.items():
            for key, boxes in _group(found).items():
                out.setdefault(key, {})[kind] = boxes
        return out
