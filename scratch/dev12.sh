source .device/device-env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
export NVFLY_COMMIT=9a1e0d4
timeout -k 10 150 python -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/gpu/test_attention_decode_wgmma_gpu.py -k two_consumer > $OUT/p2.log 2>&1; echo "rc $?" >> $OUT/p2.log; tail -3 $OUT/p2.log
SEL=(); grep -q "rc 0" $OUT/p2.log || SEL=(-k "not two_consumer")
NVFLY_TEST_REPORT=$OUT/gpu_tests_h200.json timeout -k 10 380 python -m pytest -q -m gpu -n 14 -p no:cacheprovider --tb=line tests "${SEL[@]}" > $OUT/tier.log 2>&1; echo "rc $?" >> $OUT/tier.log; tail -4 $OUT/tier.log; grep -E "^(FAILED|ERROR)" $OUT/tier.log | head -20
timeout 100 python benchmarks/attention.py --decode --quick --sq 8 16 --no-flex --no-mods --models llama70b minimax --decode-variants mma_sync wgmma_wide --name attention_decode_wgmma_wide > $OUT/wide.log 2>&1; echo "rc $?" >> $OUT/wide.log
cp benchmarks/results/attention_decode_wgmma_wide_h200.json $OUT/ 2>/dev/null
grep -E "TB/s|rc " $OUT/wide.log | sed -E 's/ +cudnn.*//; s/err [0-9.e-]+ //' | cut -c1-170
