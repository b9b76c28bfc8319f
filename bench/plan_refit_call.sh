#!/bin/bash
# A planner refit call for issue 29 (prepared in session 19; the device gave no machine that session): warm, the
# e8 host probe, bench/saved_bytes.py on the FP8 GPT-2.7B, bf16 GPT-2.7B and 32-expert layers, then the MoE cases
# again on the one-call flat update, the 4 unrun cases and 2 dense ones, 14 iterations (median after 4).
# Run: device `bash bench/plan_refit_call.sh` (results under $OUT).
cd "$(dirname "$0")/.."; export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1; t0=$SECONDS
source bench/host_probe_shapes.sh
R=/tmp/r1; mkdir -p $R
MOE="moe-e32-top4-f896-s2k-m2 moe-e4-top1-f3584-s1k-m16-sel moe-e8-top2-f3584-s2k-m6 moe-e16-top2-f1792-s1k-m8-pao"
NEW="moe-e4-top2-f2048-s8k-m1-sel gpt2.7b-s4k-m1-pao-zero mixtral-small-s4k-m2-sel-acc2 gpt760m-s16k-m1-sel"
DENSE="llama8b-w-L4-s16k-m1-sel gpt350m-s2k-m16"
python3 bench/plan_accuracy.py run --cases $MOE $NEW $DENSE gpt2.7b-s1k-m8-fp8 --deadline-s 0 --out /tmp/warm > $R/warm.log 2>&1
echo "warm done $((SECONDS-t0)) s"; grep warm $R/warm.log | tail -5
python3 bench/host_probe.py --label e8 --steps 8 $M --num-experts 8 --moe-router-topk 2 --global-batch-size 1 $C --run-dir /tmp/hp/e8 > $R/probe_e8.log 2>&1
grep SUMMARY $R/probe_e8.log; echo "probe done $((SECONDS-t0)) s"
sb() { timeout 150 python3 bench/saved_bytes.py $2 --num-layers 2 $C > $R/sb_$1.log 2>&1; echo "$1 $(grep SAVED $R/sb_$1.log | cut -c1-1500)"; }
E32="--model mixtral-small --vocab-size 32000 --seq-length 2048 --max-position-embeddings 2048 --num-experts 32 --moe-router-topk 4 --moe-ffn-hidden-size 896 --micro-batch-size 2 --global-batch-size 2"
G27="--model gpt3-2.7b --vocab-size 50304 --seq-length 1024 --max-position-embeddings 1024 --attention-dropout 0 --hidden-dropout 0 --micro-batch-size 8 --global-batch-size 8"
FP8="--fp8-format hybrid --fp8-recipe tensorwise"
sb g27fp8 "$G27 $FP8"; sb g27bf16 "$G27"; sb e32 "$E32"
echo "saved done $((SECONDS-t0)) s"
python3 bench/plan_accuracy.py run --cases $MOE $NEW $DENSE --probe-host --warm-budget-s 0 --iters 14 --warmup 4 --deadline-s $((575-SECONDS)) --out $R/pa > $R/pa.log 2>&1
grep -v '^{' $R/pa.log
cp $R/pa/results.jsonl $OUT/results.jsonl; cp $R/probe_e8.log $R/sb_*.log $OUT/; tar czf $OUT/logs.tgz -C $R --exclude='pa/runs' . 2>/dev/null
python3 - <<'P'
import json
for l in open('/tmp/r1/pa/results.jsonl'):
    r=json.loads(l); c=r['clocks']
    print(f"{r['case']:34s} {r['measured_step_ms']:7.1f} pred {r['predicted_step_ms']:7.1f} ({100*r['step_error']:+.1f}%) peak {r['measured_peak_gib']:.2f} pred {r['predicted_peak_gib']:.2f} mhz {c['sm_mhz_median']} cap {c['power_capped_share']} it {[round(x) for x in r['iter_ms_all'][4:]]}")
P
