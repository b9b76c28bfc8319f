#!/bin/bash
# Session 15's first device call (issue 29, 2026-12-04): the host's launch time, then bench/host_probe.py
# ALONE (one process at a time: no two-process factor) on the current MoE layer (one compiled graph) —
# E 8 top-2, with full and with selective recompute — and the dense reference d16;
# meanwhile nothing else runs. Then the committed cases not yet measured (plan_accuracy.py run, warmed
# with the probes), and a per-kernel profile of the 2,048-wide FP8 step. Output under $OUT.
source "$(dirname "$0")/host_probe_shapes.sh"  # C, T, D, M
FULL="--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
declare -A P=(
 [d16]="$D --global-batch-size 1"
 [e8]="$M --num-experts 8 --moe-router-topk 2 --global-batch-size 1"
 [e8full]="$M --num-experts 8 --moe-router-topk 2 --global-batch-size 1 $FULL"
 [e8sel]="$M --num-experts 8 --moe-router-topk 2 --global-batch-size 1 --recompute-activations"
)
F="--model llama-1b --vocab-size 128256 --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 2 --global-batch-size 2 --fp8-format hybrid --fp8-recipe tensorwise"
OLD="gpt2.7b-s8k-m1-sel llama8b-w-L8-s1k-m16 llama3b-s16k-m1-full"
mkdir -p /tmp/hpw; cd "$(dirname "$0")/.."; export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1; t0=$SECONDS
probe() { python3 bench/host_probe.py --label $1 --steps $2 ${P[$1]} $C --run-dir /tmp/hp/$1-$2; }
for k in "${!P[@]}"; do probe $k 2 > /tmp/hpw/$k.log 2>&1 & done
python3 bench/plan_accuracy.py run --cases $OLD --deadline-s 0 --out /tmp/warm > /tmp/hpw/old.log 2>&1 &
python3 -m meshlm pretrain $F --num-layers 1 --train-iters 2 $C --run-dir /tmp/hp/fp8w > /tmp/hpw/fp8.log 2>&1 &
wait; echo "warm done at $((SECONDS-t0)) s"; grep -l Traceback /tmp/hpw/*.log | while read f; do echo "== $f"; tail -4 $f; done
for k in d16 e8 e8full e8sel; do probe $k 8; done > $OUT/probe.log 2>&1
echo "probe done at $((SECONDS-t0)) s"; grep SUMMARY $OUT/probe.log
python3 bench/plan_accuracy.py run --cases $OLD --warm-budget-s 0 --deadline-s ${OLD_DEADLINE_S:-135} --date 2026-12-04 --out $OUT > $OUT/old.log 2>&1
echo "old cases done at $((SECONDS-t0)) s"; grep -v '^{' $OUT/old.log
timeout ${PROFILE_S:-45} python3 bench/profile_step.py $F --num-layers 8 $C --kernels 40 > $OUT/fp8_profile.log 2>&1
echo "profile done at $((SECONDS-t0)) s"
