#!/bin/bash
# The tenth set's device call for issue 29 (prepared in session 20; the device gave no machine that session):
# warm the given cases (one layer each, several at once), then measure each alone, 12 iterations by default
# (median after 4), with the d16 host probe; results under $OUT (results_<TAG>.jsonl, logs_<TAG>.tgz).
# Run: device `bash bench/plan_tenth_call.sh A <cases...>` (all 14 fit one call of ~10 min).
cd "$(dirname "$0")/.."; export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1; t0=$SECONDS
TAG=$1; shift; R=/tmp/t10$TAG; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader
python3 bench/plan_accuracy.py run --cases "$@" --deadline-s 0 --out $R/warm > $R/warm.log 2>&1
echo "warm done $((SECONDS-t0)) s"; grep -i warm $R/warm.log | tail -3
python3 bench/plan_accuracy.py run --cases "$@" --probe-host --warm-budget-s 0 --iters ${ITERS:-12} --warmup 4 --deadline-s $((${DEADLINE:-560}-SECONDS)) --out $R/pa > $R/pa.log 2>&1
grep -v '^{' $R/pa.log | tail -30
cp $R/pa/results.jsonl $OUT/results_$TAG.jsonl; tar czf $OUT/logs_$TAG.tgz -C $R warm.log pa.log pa/runs 2>/dev/null; ls -la $OUT
python3 - $R/pa/results.jsonl <<'P'
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); c=r['clocks']
    print(f"{r['case']:32s} {r['measured_step_ms']:7.1f} pred {r['predicted_step_ms']:7.1f} ({100*r['step_error']:+.1f}%) peak {r['measured_peak_gib']:.2f} pred {r['predicted_peak_gib']:.2f} mhz {c['sm_mhz_median']} cap {c['power_capped_share']} it {[round(x) for x in r['iter_ms_all'][4:]]}")
P
