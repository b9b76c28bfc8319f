"""--optimizer-cpu-offload: the host side of the optimizer step (ZeRO-Offload, Ren et al. 2021 §4:
forward and backward on the GPU, the update on the CPU).

Host memory, per offloaded element of a shard: its fp32 master and both Adam moments, 12 bytes
(float64 in the parity tests: 24), pageable and allocated at their exact size (torch's pinned
allocator rounds every block up to a power of two: up to 2× for a bucket). Beyond that only
``Staging``: one pinned buffer of HOST_BATCH elements (or of all the host elements, when fewer) per
(role, dtype) in use, the gradients' in the masters' dtype and the params' in theirs: HOST_BATCH ×
(4 + 2) bytes = 384 MiB for bf16 params (``staging_bytes``). No whole gradient, param or master copy is ever made on the host.

One step over the host groups (``host_update``), per batch of at most HOST_BATCH elements (a
fragment larger than that is split: AdamW is elementwise):
  1. the batch's reduced gradients are copied device → pinned grad staging;
  2. one fused CPU AdamW pass (``torch._fused_adamw_``: reads and writes master, moments once)
     updates the batch's masters and moments, the clip coefficient folded in as its grad scale;
then ``to_device`` copies each host master into its device params batch by batch (cast to the
params' dtype on the host into the pinned param staging, then one host → device copy), and
``to_host`` copies params into host masters (at build, and after loading weights alone).
"""

from __future__ import annotations

import torch

from .adamw import Group, adamw_

# elements a staging buffer holds (256 MiB in fp32): bounds what the offload holds on the host
# beyond the masters and moments; a 7B model's whole fp32 grad (27 GB) beside its host state (81 GB)
# would not fit a 128 GiB host
HOST_BATCH = 1 << 26
HOST_STATE_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq, bytes per offloaded element


def staging_bytes(host_elements: float, param_bytes: int = 2, master_bytes: int = 4) -> float:
    """Bytes of ``Staging``'s pinned buffers once both are in use, for ``host_elements`` offloaded
    elements: min(HOST_BATCH, host_elements) × (master + param element bytes); 384 MiB for a large
    model's bf16 params and fp32 masters."""
    return min(HOST_BATCH, host_elements) * (master_bytes + param_bytes)


class Staging:
    """The offload's pinned host buffers of ``batch`` = min(HOST_BATCH, host_elements) elements, one
    per (role, dtype), allocated on first use (pinned when ``device`` is CUDA; plain host memory on
    CPU, where the same copies run)."""

    def __init__(self, device: torch.device, host_elements: int):
        self.device, self.buffers = device, {}
        self.batch = max(1, min(HOST_BATCH, host_elements))

    def buffer(self, role: str, dtype: torch.dtype, n: int) -> torch.Tensor:
        """[n] view (n ≤ batch) of the ``role`` ("grad" or "param") buffer of ``dtype``."""
        key = (role, dtype)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(self.batch, dtype=dtype, pin_memory=self.device.type == "cuda")
        return self.buffers[key][:n]

    def nbytes(self) -> int:
        """Bytes of the buffers allocated so far."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def to_host(self, master: torch.Tensor, param: torch.Tensor) -> None:
        """master[:] = param (host [n] ← device [n], cast to the master's dtype on the host)."""
        for lo in range(0, param.numel(), self.batch):
            hi = min(lo + self.batch, param.numel())
            stage = self.buffer("param", param.dtype, hi - lo)
            stage.copy_(param[lo:hi])
            master[lo:hi].copy_(stage)

    def to_device(self, param: torch.Tensor, master: torch.Tensor) -> None:
        """param[:] = master (device [n] ← host [n], cast to the param's dtype on the host)."""
        for lo in range(0, master.numel(), self.batch):
            hi = min(lo + self.batch, master.numel())
            stage = self.buffer("param", param.dtype, hi - lo)
            stage.copy_(master[lo:hi])
            param[lo:hi].copy_(stage)


def host_batches(where: list, limit: int) -> list:
    """The fragments ``where`` [(shard index, lo, hi)] cut into batches of at most ``limit``
    elements, in order: [[(k, a, b)]], piece [a, b) of fragment k (offsets inside the fragment)."""
    out, batch, n = [], [], 0
    for k, (_, lo, hi) in enumerate(where):
        a = 0
        while a < hi - lo:
            b = a + min(hi - lo - a, limit - n)
            batch.append((k, a, b))
            n, a = n + b - a, b
            if n == limit:
                out.append(batch)
                batch, n = [], 0
    if batch:
        out.append(batch)
    return out


def host_update(groups: list, grads: list, staging: Staging, *, grad_scale: float, **kw) -> int:
    """One AdamW step of the host groups [(Group of host master/moment fragment views, where)],
    grads[i] the device grad [n] of shard i (``where``: module docstring); grads used ÷ grad_scale.
    kw: adamw_'s step, lr, betas, eps, weight_decay. Returns the number of batches."""
    count = 0
    for group, where in groups:
        for batch in host_batches(where, staging.batch):
            n = sum(b - a for _, a, b in batch)
            stage = staging.buffer("grad", group.params[0].dtype, n)
            sub = Group([], [], [], [], group.decay, group.lr_mult, group.decoupled)
            off = 0
            for k, a, b in batch:
                i, lo, _ = where[k]
                g = stage[off:off + b - a]
                g.copy_(grads[i][lo + a:lo + b])
                off += b - a
                sub.grads.append(g)
                for dst, src in ((sub.params, group.params), (sub.exp_avgs, group.exp_avgs),
                                 (sub.exp_avg_sqs, group.exp_avg_sqs)):
                    dst.append(src[k][a:b])
            adamw_([sub], fused=True, grad_scale=grad_scale, **kw)
            count += 1
    return count
