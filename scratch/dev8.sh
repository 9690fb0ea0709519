source .device/device-env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
timeout -k 10 150 python -m pytest -q -m gpu -x -p no:cacheprovider tests/gpu/test_attention_prefill_persistent_gpu.py -k shapes_against -n 0 > $OUT/persist_smoke.log 2>&1; echo "rc $?" >> $OUT/persist_smoke.log; tail -3 $OUT/persist_smoke.log
timeout -k 10 170 python -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/gpu/test_attention_prefill_persistent_gpu.py > $OUT/persist_tests.log 2>&1; echo "rc $?" >> $OUT/persist_tests.log; tail -5 $OUT/persist_tests.log
timeout 250 python benchmarks/attention.py --prefill --quick --no-mods --no-flex --prefill-variants --only-variants persistent --name attention_prefill_persistent > $OUT/persist_bench.log 2>&1; echo "rc $?" >> $OUT/persist_bench.log
cp benchmarks/results/attention_prefill_persistent_h200.json $OUT/ 2>/dev/null
tail -40 $OUT/persist_bench.log | cut -c1-200
