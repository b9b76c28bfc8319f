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

Memory: DCP's file writer copies every tensor whose storage is larger than the tensor (a view)
before writing it, and torch 2.13's keeps each written tensor of a file until the file is done, so
views of the live state would all be copied and held at once on CPU. A contiguous CPU piece is
therefore handed to DCP as an alias of its memory with a storage of its own size
(``_exact_storage``): a save copies nothing on CPU, and on a GPU it allocates no device memory
(DCP copies each piece to host memory).

``flat_boxes`` turns a flat range of a row-major tensor into boxes.
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
        self.pieces = [(torch.Size(off), _exact_storage(t)) for off, t in pieces]
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


def _exact_storage(t: torch.Tensor) -> torch.Tensor:
    """t, or (contiguous on CPU) a tensor aliasing t's memory whose storage is exactly t's bytes."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0 or \
            t.untyped_storage().nbytes() == t.nbytes:
        return t
    alias = torch.from_numpy(t.reshape(-1).view(torch.uint8).numpy())  # shares t's memory, keeps it alive
    return alias.view(t.dtype).view(t.shape)


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
