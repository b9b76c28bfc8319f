"""Training metrics: throughput, TFLOP/s per GPU, MFU, memory, and the Megatron log line.

Model FLOPs per iteration (the numerator of MFU) and the device peaks (its denominator) are
meshlm/flops.py's, the same formula the planner predicts with. MFU is reported only where the
dense bf16/fp16 tensor-core peak of the device is known; on CPU, on an unknown GPU or for an fp32
run it is None and printed "n/a".
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from .. import metrics_json
from ..flops import peak_tflops
from ..folders import space_errors_named
from ..model.moe import routing_summary


def max_memory_gb() -> Optional[float]:
    """Peak bytes allocated by torch on this rank's GPU, in GiB (2**30 bytes); None on CPU."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated() / 2 ** 30


def device_memory_gb() -> Optional[float]:
    """Total memory of this rank's GPU in GiB (what headroom is measured against); None on CPU."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2 ** 30


def memory_gb() -> Optional[float]:
    """Bytes allocated by torch on this rank's GPU now (between steps: weights, gradients and
    optimizer state, the part the bytes-per-parameter estimate covers), in GiB; None on CPU."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.memory_allocated() / 2 ** 30


def tensorboard_writer():
    """torch.utils.tensorboard.SummaryWriter, or None when the tensorboard package is missing: then,
    as in Megatron, the run trains without TensorBoard logs (validate.notes says so at start)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


_TB_TAGS = [("lm_loss", "lm loss"), ("lr", "learning-rate"), ("grad_norm", "grad-norm"),
            ("num_zeros", "num-zeros"), ("params_norm", "params-norm"), ("iter_ms", "iteration-time-ms"),
            ("loss_scale", "loss-scale"), ("tokens_per_sec", "throughput/tokens-per-sec"),
            ("tflops_per_gpu", "throughput/tflops-per-gpu"), ("mfu", "throughput/mfu"),
            ("exposed_comm_share", "communication/exposed-share"), ("bubble_fraction", "pipeline/bubble-fraction"),
            ("mem_allocated_gb", "memory/allocated-gib"), ("mem_max_allocated_gb", "memory/max-allocated-gib"),
            ("val_loss", "lm loss validation"), ("val_ppl", "lm loss validation ppl"),
            ("save_blocked_ms", "checkpoint/save-blocked-ms"), ("moe_aux_loss", "moe/load-balancing-loss"),
            ("moe_z_loss", "moe/z-loss"), ("moe_dropped_fraction", "moe/dropped-fraction")]


def tensorboard_scalars(rec: dict) -> list:
    """(tag, value) pairs TensorBoard gets for one metrics.jsonl record: Megatron's tags where it
    has them ("lm loss", "learning-rate", "grad-norm", "num-zeros", "params-norm", "loss-scale"), the
    iteration time (ms), then throughput, exposed
    communication ("communication/<kind>-s" per kind of ``comm_s``), the pipeline bubble, memory
    (GiB), checkpoint blocking (ms) and the MoE routing figures ("moe/imbalance": max / mean routes
    per expert averaged over the layers, and "moe/imbalance-layer-<l>" per layer). Values that are
    None or absent give no pair."""
    out = [(tag, rec[key]) for key, tag in _TB_TAGS if rec.get(key) is not None]
    out += [(f"communication/{kind}-s", v) for kind, v in sorted((rec.get("comm_s") or {}).items())]
    if rec.get("moe_tokens_per_expert"):
        out.append(("moe/imbalance", rec["moe_tokens_per_expert"]["imbalance"]))
        out += [(f"moe/imbalance-layer-{layer}", v) for layer, v in sorted(rec["moe_imbalance_per_layer"].items())]
    return out


class MetricsLogger:
    """Accumulates per-iteration numbers; every ``log_interval`` prints Megatron's line and
    appends one JSON object to ``<log_dir>/metrics.jsonl`` (logging rank only; a NaN or inf as
    the string metrics_json.py writes, so every line is valid JSON).

    Values in a line are averages over the iterations since the previous line (loss over the
    iterations that were not skipped), as in Megatron. ``mem_allocated_gb`` is the logging
    rank's memory in use after the step, ``mem_max_allocated_gb`` its peak, ``mem_total_gb`` the
    device's size (GiB); ``device`` the CUDA device's name ("cpu" without one) and ``world_size``
    the job's ranks (the planner's predictions for the run start from both); ``layout`` the
    constructor's (the checkpoint's layout dict and "ep"), which tells a run resumed at another
    layout apart from its earlier records. ``comm_s`` holds
    exposed communication seconds per iteration by kind ("dp": averaged over the interval; "tp",
    "pp", …: timed on the log iteration, see parallel/comm.py) and ``comm_share`` each as a share
    of the iteration time they were measured in. Every rank may call the methods; only ``enabled`` ones print and write.
    ``flops_per_iter`` counts a step of ``global_batch`` samples; a step of another size (a
    --rampup-batch-size ramp) counts in proportion.
    """

    def __init__(self, *, enabled: bool, log_dir: Optional[str], train_iters: int, log_interval: int,
                 global_batch: int, seq_length: int, flops_per_iter: float, world_size: int,
                 dtype: torch.dtype, fp16: bool = False, tensorboard_dir: Optional[str] = None,
                 layout: Optional[dict] = None):
        self.enabled, self.train_iters, self.log_interval = enabled, train_iters, log_interval
        self.layout = layout
        self.global_batch, self.seq_length = global_batch, seq_length
        self.flops_per_iter, self.world_size, self.fp16 = flops_per_iter, world_size, fp16
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        self.device = device_name or "cpu"
        self.peak = peak_tflops(device_name, dtype)
        self.path = None
        self.tb = None
        if enabled and log_dir:
            os.makedirs(log_dir, exist_ok=True)
            self.path = os.path.join(log_dir, "metrics.jsonl")
        if enabled and tensorboard_dir:
            writer = tensorboard_writer()
            self.tb = writer(log_dir=tensorboard_dir) if writer is not None else None
        self.skipped_total = self.nan_total = 0
        self._batch = global_batch
        self._reset()

    def begin(self, iteration: int) -> None:
        """Start logging after ``iteration``: a fresh run (0) empties an old metrics.jsonl in the
        same log dir; a resumed run keeps the records up to its checkpoint's iteration and drops
        later ones (written by the run that crashed after that checkpoint), so no iteration
        appears twice."""
        if self.path is None or not os.path.exists(self.path):
            return
        kept = []
        if iteration > 0:
            with open(self.path) as fh:
                kept = [line for line in fh if _iteration_of(line) <= iteration]
        with open(self.path + ".tmp", "w") as fh:
            fh.writelines(kept)
        os.replace(self.path + ".tmp", self.path)

    def _reset(self):
        self._iters = self._loss_n = self._samples = 0
        self._loss_sum = self._time_s = self._comm_s = 0.0
        self._grad_norm = None
        self._spike = False

    def train_step(self, iteration: int, consumed_samples: int, *, lm_loss: Optional[float], lr: float,
                   grad_norm: Optional[float], iter_s: float, loss_scale: float = 1.0,
                   skipped: bool = False, nan: bool = False, comm_s: Optional[float] = None,
                   bubble: Optional[float] = None, timeline: Optional[list] = None,
                   global_batch: Optional[int] = None, rank_iter_s: Optional[list] = None,
                   loss_spike: bool = False, timed_comm_s: Optional[dict] = None,
                   moe: Optional[dict] = None, params_norm: Optional[float] = None,
                   num_zeros: Optional[int] = None) -> Optional[dict]:
        """Record one iteration (iter_s seconds); on a log iteration print/write and return the record.

        global_batch: this step's samples (default the constructor's; --rampup-batch-size changes
        it): the line shows the last step's, tokens/s and TFLOP/s count every step's.
        comm_s: seconds spent waiting for the DP gradient reduction after backward (the exposed,
        non-overlapped part). bubble: idle share of the pipeline schedule, averaged over the stages (0–1);
        timeline: this iteration's forward_backward events, written to metrics.jsonl.
        rank_iter_s: on a log iteration, every rank's seconds per iteration outside collectives
        over the interval, in rank order (training/stragglers.py), written as ``rank_iter_s``.
        loss_spike: this iteration's loss was a spike (training/faults.py): the interval's record
        gets ``"loss_spike": true``.
        timed_comm_s: {kind: exposed seconds} of this (log) iteration's inline collectives and
        pipeline waits (``comm.stop_timing()``).
        moe: on a log iteration, the interval's ``model.moe.routing_stats``: the record gets
        ``routing_summary``'s moe_* figures (per step over the interval) and the line shows them.
        params_norm, num_zeros: on a log iteration, --log-params-norm's and --log-num-zeros-in-grad's
        figures (MixedPrecisionOptimizer.params_norm / zeros_in_grad), recorded and shown as Megatron's.
        """
        self._iters += 1
        self._batch = self.global_batch if global_batch is None else global_batch
        self._samples += self._batch
        self._time_s += iter_s
        self._last_iter_s = iter_s
        self._comm_s += comm_s or 0.0
        self._spike = self._spike or loss_spike
        self.skipped_total += int(skipped)
        self.nan_total += int(nan)
        if lm_loss is not None and not skipped and not nan:
            self._loss_sum += lm_loss
            self._loss_n += 1
        if grad_norm is not None:
            self._grad_norm = grad_norm
        if iteration % self.log_interval and iteration != self.train_iters:
            return None
        rec = self._record(iteration, consumed_samples, lr, loss_scale, comm_s is not None,
                           bubble, timeline, timed_comm_s or {})
        if moe is not None:
            rec.update(routing_summary(moe, self._iters))
        rec.update({k: v for k, v in (("params_norm", params_norm), ("num_zeros", num_zeros)) if v is not None})
        if rank_iter_s is not None:
            rec["rank_iter_s"] = rank_iter_s
        if self._spike:
            rec["loss_spike"] = True
        self._reset()
        if self.enabled:
            print(self._line(rec), flush=True)
            self._write(rec)
        return rec

    def _record(self, iteration, consumed, lr, loss_scale, has_comm, bubble, timeline, timed) -> dict:
        n, t = self._iters, self._time_s
        tflops = self.flops_per_iter * self._samples / self.global_batch / t / self.world_size / 1e12 \
            if t > 0 else None
        rec = {
            "iteration": iteration, "consumed_samples": consumed,
            "lm_loss": self._loss_sum / self._loss_n if self._loss_n else None,
            "lr": lr, "grad_norm": self._grad_norm, "iter_ms": 1000.0 * t / n,
            "global_batch_size": self._batch,
            "tokens_per_sec": self._samples * self.seq_length / t if t > 0 else None,
            "tflops_per_gpu": tflops,
            "mfu": tflops / self.peak if tflops is not None and self.peak else None,
            "mem_allocated_gb": memory_gb(), "mem_max_allocated_gb": max_memory_gb(),
            "mem_total_gb": device_memory_gb(),
            "skipped_iters": self.skipped_total, "nan_iters": self.nan_total,
            "device": self.device, "world_size": self.world_size,
        }
        if self.layout:
            rec["layout"] = self.layout
        if self.fp16:
            rec["loss_scale"] = loss_scale
        if has_comm and t > 0:
            rec["exposed_comm_share"] = self._comm_s / t
        comm_s = ({"dp": self._comm_s / n} if has_comm else {}) | dict(timed)
        if comm_s and t > 0:
            rec["comm_s"] = comm_s
            rec["comm_share"] = {k: (self._comm_s / t if k == "dp" else v / self._last_iter_s)
                                 for k, v in comm_s.items()}
        if bubble is not None:
            rec["bubble_fraction"] = bubble
        if timeline:
            t0 = min(e["start"] for e in timeline)
            rec["pipeline_timeline"] = [dict(e, start=e["start"] - t0, end=e["end"] - t0) for e in timeline]
        return rec

    def _line(self, r: dict) -> str:
        loss = "n/a" if r["lm_loss"] is None else f"{r['lm_loss']:.6E}"
        parts = [f" iteration {r['iteration']:8d}/{self.train_iters:8d}",
                 f"consumed samples: {r['consumed_samples']:12d}",
                 f"elapsed time per iteration (ms): {r['iter_ms']:.1f}",
                 f"learning rate: {r['lr']:.3E}",
                 f"global batch size: {r['global_batch_size']:5d}",
                 f"lm loss: {loss}"]
        if self.fp16:
            parts.append(f"loss scale: {r['loss_scale']:.1f}")
        parts += [f"grad norm: {_fmt(r['grad_norm'], '.3f')}"]
        if "num_zeros" in r:
            parts.append(f"num zeros: {r['num_zeros']}")
        if "params_norm" in r:
            parts.append(f"params norm: {r['params_norm']:.3f}")
        parts += [f"tokens/s: {_fmt(r['tokens_per_sec'], '.0f')}",
                  f"TFLOP/s/GPU: {_fmt(r['tflops_per_gpu'], '.1f')}",
                  "MFU: " + ("n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%")]
        if r["mem_allocated_gb"] is not None:
            parts.append(f"mem (GiB): {r['mem_allocated_gb']:.2f} (peak {r['mem_max_allocated_gb']:.2f})")
        if "moe_tokens_per_expert" in r:
            n = r["moe_tokens_per_expert"]
            parts += [f"moe {k} loss: {_fmt(r[f'moe_{k}_loss'], '.4E')}" for k in ("aux", "z")
                      if r[f"moe_{k}_loss"] is not None]
            parts.append(f"tokens/expert: min {n['min']:.0f} max {n['max']:.0f} imbalance {n['imbalance']:.2f}"
                         f" dropped {100 * r['moe_dropped_fraction']:.1f}%")
        if "bubble_fraction" in r:
            parts.append(f"bubble: {100 * r['bubble_fraction']:.1f}%")
        if r.get("comm_share"):
            parts.append("exposed comm: " + " ".join(f"{k.upper()} {100 * v:.1f}%"
                                                     for k, v in r["comm_share"].items()))
        if self.fp16 or r["skipped_iters"] or r["nan_iters"]:
            parts += [f"number of skipped iterations: {r['skipped_iters']:3d}",
                      f"number of nan iterations: {r['nan_iters']:3d}"]
        return " | ".join(parts) + " |"

    def evaluation(self, iteration: int, consumed_samples: int, val_loss: float) -> dict:
        """Print Megatron's validation block and write {iteration, val_loss, val_ppl} (a NaN loss
        has a NaN perplexity; a loss above 20 the perplexity of 20)."""
        ppl = val_loss if math.isnan(val_loss) else math.exp(min(20.0, val_loss))
        rec = {"iteration": iteration, "consumed_samples": consumed_samples,
               "val_loss": val_loss, "val_ppl": ppl}
        if self.enabled:
            line = f" validation loss at iteration {iteration} | lm loss value: {val_loss:.6E} | " \
                   f"lm loss PPL: {ppl:.6E} |"
            print("-" * len(line) + "\n" + line + "\n" + "-" * len(line), flush=True)
            self._write(rec)
        return rec

    def checkpoint(self, iteration: int, consumed_samples: int, path: str, blocked_s: float,
                   background: bool) -> dict:
        """Write {iteration, consumed_samples, checkpoint, async_save, save_blocked_ms}: a save of
        ``path`` that kept the training loop waiting ``blocked_s`` seconds (the trainer prints the
        line)."""
        rec = {"iteration": iteration, "consumed_samples": consumed_samples, "checkpoint": path,
               "async_save": background, "save_blocked_ms": 1000.0 * blocked_s}
        if self.enabled:
            self._write(rec)
        return rec

    def _write(self, rec: dict) -> None:
        if self.path:  # a full disk: one line naming the file
            with space_errors_named(self.path, os.path.dirname(self.path)), open(self.path, "a") as fh:
                fh.write(metrics_json.dumps(rec) + "\n")
        if self.tb is not None:
            for tag, value in tensorboard_scalars(rec):
                self.tb.add_scalar(tag, value, rec["iteration"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _iteration_of(line: str) -> float:
    """The iteration of a metrics.jsonl line (either form of metrics_json.py); infinity for a blank
    line or one that is not JSON (cut off by a killed run), which the cut-back then drops."""
    try:
        return metrics_json.loads(line).get("iteration", 0) if line.strip() else math.inf
    except ValueError:
        return math.inf
