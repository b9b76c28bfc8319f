"""Point-to-point transfer of activations and their gradients between pipeline stages.

Every tensor that crosses a stage boundary has one shape known from the config,
[s, b, h] (sequence-parallel: [s/tp, b, h]; context-parallel: s/cp), and the params dtype, so no
shape is exchanged. One P2P step of a schedule is posted as one batch
(``torch.distributed.batch_isend_irecv``: an NCCL group on GPUs, isend/irecv lists on gloo) and
waited for as a whole. While comm.py's timing is on (log iterations) the time a rank is blocked
in those waits is recorded as kind "pp": transfer plus waiting for the peer stage, so it holds the
pipeline bubble too.

Memory: once a stage's output has been sent, only its autograd graph is needed; ``release``
frees its storage (Megatron's ``deallocate_output_tensor``) and ``backward_from`` later runs the
graph from that output with the received gradient, calling the autograd engine directly because
``torch.autograd.backward`` would reject a gradient whose shape differs from the freed output's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.variable import Variable

from . import watchdog
from .comm import begin_timed, end_timed
from .mesh import ParallelState
from .schedules import P2P

# Pipeline groups whose neighbour connections are set up (see StageComm._connect): once per group.
# The group objects themselves are kept (compared by identity): an id() can be reused by a new
# group once an old one is freed, which would skip the new group's warm-up.
_CONNECTED: list = []


class StageComm:
    """Sends and receives of one pipeline rank.

    shape: activation shape [s, b, h] (split dims already applied); dtype: params dtype.
    Neighbours wrap around (the last rank's chunk c feeds rank 0's chunk c + 1 when interleaved).
    """

    def __init__(self, ps: ParallelState, shape: tuple, dtype: torch.dtype):
        self.ps, self.shape, self.dtype = ps, tuple(shape), dtype
        self.next = ps.pp_ranks[(ps.pp_rank + 1) % ps.pp]
        self.prev = ps.pp_ranks[(ps.pp_rank - 1) % ps.pp]
        if ps.pp > 1 and not any(g is ps.pp_group for g in _CONNECTED):
            self._connect()
            _CONNECTED.append(ps.pp_group)

    def _connect(self) -> None:
        """Exchange one tensor with both neighbours, in one batch on every rank of the pipeline.

        NCCL sets up a p2p connection on first use, blocking the host in the group launch until
        the peer uses it too; a schedule whose first send in some direction is batched with a
        receive that the peer posts separately (GPipe, interleaved) would deadlock there. Also
        satisfies batch_isend_irecv's rule that the first op in a group involves all its ranks.
        """
        bufs = [torch.zeros(self.shape, dtype=self.dtype, device=self.ps.device) for _ in range(4)]
        ops = [dist.P2POp(dist.isend, bufs[0], self.next, self.ps.pp_group),
               dist.P2POp(dist.irecv, bufs[1], self.prev, self.ps.pp_group),
               dist.P2POp(dist.isend, bufs[2], self.prev, self.ps.pp_group),
               dist.P2POp(dist.irecv, bufs[3], self.next, self.ps.pp_group)]
        _post_and_wait(ops, "pp send/recv (connection warm-up)", self.ps.pp_group, (self.prev, self.next))

    def run(self, step: P2P, outgoing: dict) -> dict:
        """Post every op of ``step`` as one batch and wait for all of them.

        outgoing: {Action(SEND_*): tensor} for the sends. Returns {Action(RECV_*): tensor} of
        fresh buffers [s, b, h] filled by the peers.
        """
        ops, received, peers = [], {}, []
        for op in step.ops:
            if op.kind.startswith("SEND"):
                peer = self.next if op.kind == "SEND_F" else self.prev
                ops.append(dist.P2POp(dist.isend, outgoing[op].contiguous(), peer, self.ps.pp_group))
                peers.append(peer)
            else:
                peer = self.prev if op.kind == "RECV_F" else self.next
                buf = torch.empty(self.shape, dtype=self.dtype, device=self.ps.device)
                received[op] = buf
                ops.append(dist.P2POp(dist.irecv, buf, peer, self.ps.pp_group))
                peers.append(peer)
        if ops:
            name = "pp " + " + ".join(op.kind.lower().replace("_", " ") for op in step.ops)
            start = begin_timed(self.ps.device)
            _post_and_wait(ops, name, self.ps.pp_group, tuple(dict.fromkeys(peers)))
            end_timed("pp", start, self.ps.device)
        return received


def _post_and_wait(ops: list, name: str, group, peers: tuple) -> None:
    """Post ``ops`` as one batch and wait for all of them (watched as ``name`` with ``peers``)."""
    watchdog.enter(name, group, peers)
    try:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    finally:
        watchdog.leave()


def release(output: torch.Tensor) -> None:
    """Free a sent output's storage, keeping its grad_fn for backward (1-element placeholder).

    Skipped for views (``output._base`` set): their storage belongs to the base tensor.
    """
    if output._base is None:
        output.data = torch.empty((1,), dtype=output.dtype, device=output.device)


def backward_from(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backpropagate ``grad`` [s, b, h] from ``output`` (possibly released) into the stage's
    parameters and input, without the shape check of ``torch.autograd.backward``."""
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True)
