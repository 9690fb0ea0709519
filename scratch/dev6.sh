source .device/device-env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
for run in default sq1; do
  if [ $run = sq1 ]; then export NVFLY_ROUTING_SDPA_CUDNN_SQ1=1; fi
  timeout 200 python benchmarks/models.py --quick --cases minimax-decode llama-decode > $OUT/models_$run.log 2>&1; echo "rc $?" >> $OUT/models_$run.log
  cp benchmarks/results/models_h200.json $OUT/models_$run.json 2>/dev/null
  grep -E "x[0-9]|rc |speedup" $OUT/models_$run.log | tail -12
done
unset NVFLY_ROUTING_SDPA_CUDNN_SQ1
timeout 120 python benchmarks/routing_overhead.py --profile --rounds 3 > $OUT/profile.log 2>&1; echo "rc $?" >> $OUT/profile.log
tail -60 $OUT/profile.log
