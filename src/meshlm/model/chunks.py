"""This rank's model chunks: the GPTModels of its pipeline stages (one, or v under interleaving).

parallel/pipeline.py partitions the layers (``stage_layers``) and runs the chunks it is given.
"""

from __future__ import annotations

import torch

from .. import fast
from ..config import Config
from ..fp8_rules import fp8_layers
from ..dtypes import wide
from ..parallel.fp8 import Fp8Recipe
from ..parallel.fp8_delayed import DelayedState
from ..parallel.mesh import ParallelState
from ..parallel.pipeline import stage_layers, virtual_size
from .recompute import Recompute
from .transformer import GPTModel


def build_model_chunks(cfg: Config, ps: ParallelState, vocab_size: int,
                       params_dtype: torch.dtype = torch.float32) -> list:
    """This rank's model chunks: one GPTModel, or v with interleaving (chunk c = model stage c·PP + r).

    Stage 0 gets the embedding (pre_process), the last stage the final norm, output layer and loss
    (post_process). Weights depend only on the seed and global layer index, so any partition
    starts from the same model. --fast-path decides compiled layers (meshlm/fast.py); --fp8-format
    the FP8 layers (``apply_fp8``). Raises ConfigError for an invalid partition.
    """
    ranges = stage_layers(cfg)
    v, last = virtual_size(cfg), len(ranges) - 1
    chunks = []
    for c in range(v):
        s = c * ps.pp + ps.pp_rank
        chunks.append(GPTModel(cfg.model, ps, vocab_size, seed=cfg.training.seed, layer_ids=ranges[s],
                               pre_process=s == 0, post_process=s == last,
                               sequence_parallel=cfg.parallel.sequence_parallel, params_dtype=params_dtype,
                               recompute=Recompute.of(cfg.training),
                               use_cpu_initialization=cfg.parallel.use_cpu_initialization,
                               fast=fast.enabled(cfg.training.fast_path, ps.device)))
        apply_fp8(chunks[-1], Fp8Recipe.of(cfg.training, ps.device), fp8_layers(cfg.training, cfg.model.num_layers),
                  param_gather=cfg.training.fp8_param_gather)
    return chunks


def apply_fp8(chunk, recipe, in_fp8: list, param_gather: bool = False) -> None:
    """Give every TP linear (those with an ``fp8`` attribute) of chunk's layers i with in_fp8[i] the
    FP8 recipe (None: leave them in the params' dtype). The embedding and output layer stay out.
    param_gather (--fp8-param-gather): also mark each such linear's weight ``fp8_gather`` = the
    recipe, so that the DDP keeps it in an FP8 buffer (parallel/data.py). A delayed recipe gives each
    such linear its amax histories (``fp8_state``, parallel/fp8_delayed.py)."""
    if recipe is None:
        return
    for i, layer in chunk.layers.items():
        if in_fp8[int(i)]:
            for m in layer.modules():
                if hasattr(m, "fp8"):
                    m.fp8 = recipe
                    if recipe.delayed and hasattr(m, "fp8_state"):
                        m.fp8_state = DelayedState(recipe, wide(m.weight.dtype), m.weight.device)
                    if param_gather:
                        m.weight.fp8_gather = recipe
