"""Pairwise combinations of every flag that changes how a training step is computed.

``FACTORS`` lists each flag (or group of flags that only make sense together, like a pipeline
schedule and its sizes) with its levels. ``pairwise_cases()`` returns a small list of parity
Cases in which every pair of levels of two factors that some valid layout allows appears at least
once (a covering array of strength 2, built greedily as in Cohen et al. 1997, "The AETG
System"), deterministic for a given seed (the default, 0, gives the fewest cases of seeds 0–11:
35, as do 2, 8 and 9; 0 needs the fewest process starts). ``possible`` states which combinations
a layout cannot have (meshlm's rules in validate.py); meshlm's own validation must accept every
generated case (the test checks). Context parallelism and MoE / expert parallelism are factors
like the others, so each level of CP (both --cp-comm-type values) and of MoE (EP 1 and 2) meets
every level of every other factor: interleaved PP, ZeRO-1 overlaps, recompute, packed documents,
GQA, per-token loss, and each other; so does each ZeRO stage (--data-parallel-sharding-strategy).
"""

from __future__ import annotations

import dataclasses
import itertools
import random

from parity import SEQ, Case
from test_moe_parallel import MOE

MAX_WORLD = 8  # processes one CPU test may spawn

PIPELINES = {  # name: the Case fields of that pipeline layout (4 layers unless said)
    "pp1": dict(pp=1),
    "1f1b": dict(pp=2, schedule="1f1b"),
    "gpipe": dict(pp=2, schedule="gpipe"),
    "interleaved": dict(pp=2, vpp=2),
    "pp3-first-1": dict(pp=3, first=1, layers=5),  # 1, 2, 2 layers
    "last-1": dict(pp=2, last=1),
    "pp4": dict(pp=4, schedule="1f1b"),
}

CONTEXTS = {  # --context-parallel-size and --cp-comm-type (the type only matters at CP > 1)
    "cp1": dict(cp=1),
    "cp2-p2p": dict(cp=2, cp_comm="p2p"),
    "cp2-all_gather": dict(cp=2, cp_comm="all_gather"),
}

MOES = {  # dense, or 4 experts top-2 in layers 0, 2, … (test_moe_parallel.MOE: sigmoid routing with the
    "dense": dict(),  # expert bias, load-balancing and z-loss, a shared expert) at EP 1 or 2
    "moe-ep1": dict(experts=4, moe=MOE),
    "moe-ep2": dict(experts=4, ep=2, moe=MOE),
}

FACTORS = {
    "tp": [1, 2, 4],
    "sp": [False, True],
    "pipeline": list(PIPELINES),
    "dp": [1, 2, 4],
    "zero": [0, 1, 2, 3],  # --data-parallel-sharding-strategy no_shard, optim (ZeRO-1), optim_grads, optim_grads_params
    "overlap_grad": [False, True],
    "overlap_param": [False, True],
    "bucket": [1, None],
    "tied": [True, False],
    "pos": ["learned_absolute", "rope"],
    "norm": ["LayerNorm", "RMSNorm"],
    "swiglu": [False, True],
    "groups": [None, 1, 2],
    "recompute": ["none", "selective", "full-uniform-1", "full-block-2"],
    "micro": [1, 2],
    "per_token": [False, True],
    "packed": [False, True],
    "cp": list(CONTEXTS),
    "moe": list(MOES),
}


GROUPED = {"pipeline": PIPELINES, "cp": CONTEXTS, "moe": MOES}  # factors whose levels set several fields


def to_case(a: dict) -> Case:
    fields = {k: v for k, v in a.items() if k not in GROUPED}
    for factor, levels in GROUPED.items():
        fields.update(levels[a[factor]])
    case = Case(**fields)
    return dataclasses.replace(case, batch=batch_of(case))


def batch_of(case: Case) -> int:
    """The case's global batch: at least 4 samples (so that most cases accumulate gradients over
    several micro-batches) and at least PP micro-batches per DP rank (every 1F1B phase: warm-up,
    steady state, cool-down), no larger: a step's cost grows with its micro-batches and proves no
    more beyond that."""
    return max(4, case.dp * case.micro * case.pp)


def possible(a: dict) -> bool:
    """Whether assignment ``a`` (factor → level) is a layout meshlm accepts, within MAX_WORLD."""
    c = to_case(a)
    microbatches = c.batch // (c.micro * c.dp)
    return (c.world <= MAX_WORLD
            and not (c.sp and c.tp == 1)
            and not (c.overlap_param and not c.zero)
            and not (c.vpp and microbatches % c.pp)
            and not (c.experts and c.tp > 1 and not c.sp)  # MoE under TP routes SP's share of the tokens
            and (c.dp * c.cp) % c.ep == 0                   # experts split the DP × CP ranks
            and SEQ % (2 * c.cp) == 0                       # 2·CP equal chunks of the sequence
            and not (c.sp and (SEQ // c.cp) % c.tp))        # SP splits a CP rank's rows over TP


def _pairs(a: dict) -> set:
    return {((f, a[f]), (g, a[g])) for f, g in itertools.combinations(FACTORS, 2)}


def pairwise_cases(seed: int = 0, tries: int = 30) -> tuple:
    """(cases, impossible): a deterministic list of Cases covering every possible pair of factor
    levels (see module doc), and the pairs no possible layout has."""
    rng = random.Random(seed)
    wanted = {((f, x), (g, y)) for f, g in itertools.combinations(FACTORS, 2)
              for x in FACTORS[f] for y in FACTORS[g]}
    chosen, impossible = [], set()
    while wanted:
        target = min(wanted, key=repr)  # deterministic choice of the next pair to cover
        best, best_gain = None, 0
        for _ in range(tries):
            a = {f: rng.choice(levels) for f, levels in FACTORS.items()}
            a.update(dict(target))
            fixed = {k for k, _ in target}
            for f in rng.sample(list(FACTORS), len(FACTORS)):
                if f in fixed:
                    continue
                scores = [(len(_pairs({**a, f: v}) & wanted), v) for v in FACTORS[f] if possible({**a, f: v})]
                if scores:
                    a[f] = max(scores, key=lambda s: s[0])[1]
            gain = len(_pairs(a) & wanted)
            if possible(a) and gain > best_gain:
                best, best_gain = dict(a), gain
        if best is None:
            wanted.discard(target)  # no layout has this pair (e.g. TP=4 with PP=4 within 8 ranks)
            impossible.add(target)
            continue
        wanted -= _pairs(best)
        chosen.append(best)
    return [to_case(a) for a in chosen], impossible
