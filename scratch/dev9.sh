source .device/device-env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
export NVFLY_COMMIT=53f3606
timeout -k 10 150 python -m pytest -q -n 0 -m gpu -p no:cacheprovider tests/gpu/test_attention_decode_wgmma_gpu.py > $OUT/wg_tests.log 2>&1; echo "rc $?" >> $OUT/wg_tests.log; tail -4 $OUT/wg_tests.log
grep -E "^(FAILED|ERROR)|Error" $OUT/wg_tests.log | head -10
timeout 250 python benchmarks/attention.py --decode --quick --sq 8 --no-flex --no-mods --models llama70b minimax --decode-variants wgmma wgmma_combine_kernel --name attention_decode_wgmma > $OUT/wg_bench.log 2>&1; echo "rc $?" >> $OUT/wg_bench.log
cp benchmarks/results/attention_decode_wgmma_h200.json $OUT/ 2>/dev/null
grep -vE "Warning|warn|^\s+return" $OUT/wg_bench.log | tail -14 | cut -c1-220
timeout 120 python -m pytest -q -n 4 -m gpu -p no:cacheprovider tests/gpu/test_attention_decode_variants_gpu.py > $OUT/variants.log 2>&1; echo "rc $?" >> $OUT/variants.log; tail -3 $OUT/variants.log
