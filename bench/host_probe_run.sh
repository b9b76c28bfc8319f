#!/bin/bash
# The host-time probe's device call (issue 29, 2026-12-04): bench/host_probe.py on few-token configs of every
# layer kind (warm in parallel, one of each compiled graph, then measured in two streams), one MoE case at its real shape with and without
# --manual-gc, and a per-kernel profile of an FP8 step at 4,096 tokens. Output under $OUT.
source "$(dirname "$0")/host_probe_shapes.sh"  # C, T, D, M
R="--model mixtral-small --num-layers 8 --vocab-size 32000 --seq-length 4096 --max-position-embeddings 4096 --num-experts 16 --moe-router-topk 1 --moe-ffn-hidden-size 3584 --micro-batch-size 2 --global-batch-size 2"
F="--model gpt3-2.7b --num-layers 8 --vocab-size 50304 --seq-length 4096 --max-position-embeddings 4096 --attention-dropout 0 --hidden-dropout 0 --micro-batch-size 1 --global-batch-size 1 --fp8-format hybrid --fp8-recipe tensorwise"
declare -A P=(
 [d16]="$D --global-batch-size 1"
 [d4]="$D --num-layers 4 --global-batch-size 1"
 [d16a4]="$D --global-batch-size 4"
 [d16fp8]="$D --global-batch-size 1 --fp8-format hybrid --fp8-recipe tensorwise"
 [d16full]="$D --global-batch-size 1 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
 [d16zero]="$D --global-batch-size 1 --use-distributed-optimizer"
 [g24]="--model gpt2-350m --vocab-size 8192 --attention-dropout 0 --hidden-dropout 0 $T --global-batch-size 1"
 [e4]="$M --num-experts 4 --moe-router-topk 1 --global-batch-size 1"
 [e8]="$M --num-experts 8 --moe-router-topk 2 --global-batch-size 1"
 [e16]="$M --num-experts 16 --moe-router-topk 1 --global-batch-size 1"
 [e32]="$M --num-experts 32 --moe-router-topk 4 --global-batch-size 1"
 [e16a2]="$M --num-experts 16 --moe-router-topk 1 --global-batch-size 2"
)
mkdir -p /tmp/hpw; cd "$(dirname "$0")/.."; export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1; t0=$SECONDS
probe() { python3 bench/host_probe.py --label $1 --steps $2 ${P[$1]:-} "${@:3}" $C --run-dir /tmp/hp/$1-$2; }
for k in d16 d16fp8 d16full g24 e4 e8 e16 e32; do probe $k 2 > /tmp/hpw/$k.log 2>&1 & done
python3 bench/host_probe.py --label real --steps 2 $R $C --run-dir /tmp/hp/rw > /tmp/hpw/real.log 2>&1 &
python3 bench/host_probe.py --label fp8w --steps 2 $F $C --run-dir /tmp/hp/fw > /tmp/hpw/fp8.log 2>&1 &
wait; echo "warm done at $((SECONDS-t0)) s"; for f in $(grep -l Traceback /tmp/hpw/*.log); do echo "== $f"; tail -5 $f; done > $OUT/warm_errors.log; cat $OUT/warm_errors.log
(for k in d16 d4 d16a4 d16fp8 d16full d16zero g24; do probe $k 10; done) > $OUT/dense.log 2>&1 &
(for k in e4 e8 e16 e32 e16a2; do probe $k 10; done; probe e16 24 --manual-gc) > $OUT/moe.log 2>&1 &
wait; echo "tiny done at $((SECONDS-t0)) s"
python3 bench/host_probe.py --label real --steps 14 $R $C --run-dir /tmp/hp/r1 > $OUT/real.log 2>&1
python3 bench/host_probe.py --label real-mgc --steps 14 $R $C --manual-gc --run-dir /tmp/hp/r2 >> $OUT/real.log 2>&1
echo "real done at $((SECONDS-t0)) s"
python3 bench/profile_step.py $F $C --kernels 70 > $OUT/fp8_profile.log 2>&1
echo "profile done at $((SECONDS-t0)) s"
grep -h SUMMARY $OUT/dense.log $OUT/moe.log $OUT/real.log
