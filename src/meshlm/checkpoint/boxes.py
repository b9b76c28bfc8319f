"""Boxes: the pieces of a global tensor that one rank holds, described to torch.distributed.checkpoint.

DCP saves and loads a tensor as *chunks* (boxes: an offset and a size per dimension) of one
global tensor, and reshards on load by intersecting the boxes a rank asks for with the boxes that
were saved. A ``Boxes`` is a global-shaped placeholder tensor holding any number of local views,
each a box of the global tensor: uneven, non-contiguous and clipped pieces alike (a TP shard of
[Q; K; V] rows, vocabulary rows without their padding, a ZeRO-1 flat range of a weight). It
implements DCP's ``_Checkpointable`` protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``; private in torch 2.6 and 2.13, the way DTensor and Megatron-core's
CheckpointableShardedTensor talk to DCP). Saving reads the views; loading writes into them, so
nothing is gathered or staged. The views of one Boxes must not overlap; boxes saved by several
ranks are written once when identical (DCP's dedup: DP replicas) and must not overlap otherwise.

``flat_boxes`` turns a flat range of a row-major tensor into boxes; ``split_box`` cuts a box into
pieces of bounded size (the save's memory bound, see checkpoint/model_space.py).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class Boxes(torch.Tensor):
    """A global tensor of ``shape`` of which this rank holds ``pieces``: [(offsets, view)], each view
    the box [offsets, offsets + view.shape) of the global tensor (same dtype and device for all).

    Only DCP may use it: any tensor operation raises. Raises ValueError for no pieces, mixed
    dtypes, or a piece outside ``shape``.
    """

    @staticmethod
    def __new__(cls, shape, pieces):
        if not pieces:
            raise ValueError("Boxes needs at least one piece")
        first = pieces[0][1]
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=first.dtype, device=first.device)

    def __init__(self, shape, pieces):
        self.pieces = [(torch.Size(off), t) for off, t in pieces]
        for off, t in self.pieces:
            if t.dtype != self.dtype or any(o + n > s for o, n, s in zip(off, t.shape, shape)) \
                    or len(off) != len(shape) or t.dim() != len(shape):
                raise ValueError(f"piece at {tuple(off)} {tuple(t.shape)} {t.dtype} does not fit "
                                 f"{tuple(shape)} {self.dtype}")

    def __create_write_items__(self, fqn: str, obj: object) -> list:
        return [WriteItem(index=MetadataIndex(fqn, off, i), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.shape),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.shape))
                for i, (off, t) in enumerate(self.pieces)]

    def __create_chunk_list__(self) -> list:
        return [ChunkStorageMetadata(offsets=off, sizes=t.shape) for off, t in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self.pieces) and self.pieces[index.index][0] == index.offset:
            return self.pieces[index.index][1]
        for off, t in self.pieces:
            if off == index.offset:
                return t
        raise ValueError(f"{index.fqn}: this rank holds no piece at {index.offset}")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"Boxes is a checkpoint placeholder; {func} is not supported on it")

    def __repr__(self) -> str:
        return f"Boxes({tuple(self.shape)}, {self.dtype}, {[(tuple(o), tuple(t.shape)) for o, t in self.pieces]})"


def flat_boxes(shape, lo: int, hi: int) -> list:
    """[(offsets, sizes)]: boxes of a row-major tensor of ``shape`` covering its flat elements
    [lo, hi) exactly, in order, each a contiguous flat range: at most 2·(ndim − 1) + 1 boxes
    (for a matrix: the rest of a first row, whole rows, the start of a last row)."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    out = []

    def within(row, a, b):  # flat [a, b) of one row, recursively
        return [((row,) + off, (1,) + size) for off, size in flat_boxes(shape[1:], a, b)]

    if first == last:
        return within(first, lo - first * inner, hi - first * inner)
    start = first
    if lo % inner:
        out += within(first, lo % inner, inner)
        start += 1
    end = last + 1 if hi % inner == 0 else last
    if end > start:
        out.append(((start,) + (0,) * (len(shape) - 1), (end - start,) + shape[1:]))
    if hi % inner:
        out += within(last, 0, hi % inner)
    return out


def split_box(offsets, sizes, max_numel: int) -> list:
    """[(offsets, sizes)]: the box cut along its leading dimensions into boxes of at most
    ``max_numel`` elements each (a box of one element per dimension is never cut; max_numel ≥ 1)."""
    offsets, sizes = tuple(offsets), tuple(sizes)
    if math.prod(sizes) <= max_numel or not sizes:
        return [(offsets, sizes)]
    d = next(i for i, n in enumerate(sizes) if n > 1)
    inner = math.prod(sizes[d + 1:])
    step = max(max_numel // inner, 1)
    out = []
    for s in range(0, sizes[d], step):
        off = offsets[:d] + (offsets[d] + s,) + offsets[d + 1:]
        size = sizes[:d] + (min(step, sizes[d] - s),) + sizes[d + 1:]
        out += split_box(off, size, max_numel) if step == 1 else [(off, size)]
    return out
