source .device/device-env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
export NVFLY_TEST_REPORT=$OUT/gpu_tests_h200.json
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv > $OUT/smi.txt
timeout 420 python -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=line tests > $OUT/gpu_tier.log 2>&1; echo "tier rc $?" >> $OUT/gpu_tier.log
grep -E "passed|failed|^FAILED|rc " $OUT/gpu_tier.log | tail -30
