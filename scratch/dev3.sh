source .device/device-env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv > $OUT/smi.txt
timeout 200 python -m pytest -q -m gpu -n 12 -p no:cacheprovider tests/gpu/test_attention_decode_pdl_gpu.py tests/gpu/test_attention_decode_variants_gpu.py tests/gpu/test_scaled_a16_gpu.py tests/gpu/test_attention_decode_gpu.py tests/gpu/test_attention_mla_gpu.py tests/gpu/test_foundation_gpu.py tests/gpu/test_rmsnorm_topk_gpu.py tests/gpu/test_topk_sampling_gpu.py > $OUT/tests.log 2>&1; echo "tests rc $?" >> $OUT/tests.log; tail -15 $OUT/tests.log
timeout 150 python benchmarks/attention.py --decode --quick --sq 1 --no-flex --decode-variants pdl fixup --name attention_decode_pdl > $OUT/pdl.log 2>&1; echo "rc $?" >> $OUT/pdl.log
timeout 100 python benchmarks/attention.py --decode --quick --sq 1 --no-flex --fp8 --models llama8b minimax --decode-variants pdl fixup --name attention_decode_pdl_fp8 > $OUT/pdl_fp8.log 2>&1; echo "rc $?" >> $OUT/pdl_fp8.log
timeout 90 python -m benchmarks.scaled --a16 --quick --a16-m 1 4 16 --a16-variants bits_ahead prefetch1 prefetch2 bits_ahead_prefetch1 bits_ahead_prefetch2 --name scaled_mxfp4_a16_prefetch > $OUT/a16.log 2>&1; echo "rc $?" >> $OUT/a16.log
timeout 90 python benchmarks/attention.py --decode --quick --models llama70b minimax --sq 8 --no-flex --decode-variants rows16 warp32 --name attention_decode_rows64 > $OUT/rows64.log 2>&1; echo "rc $?" >> $OUT/rows64.log
cp benchmarks/results/attention_decode_pdl*_h200.json benchmarks/results/scaled_mxfp4_a16_prefetch_h200.json benchmarks/results/attention_decode_rows64*_h200.json $OUT/ 2>/dev/null
grep -h "TB/s\|rc \|geomean" $OUT/pdl*.log $OUT/rows64.log | tail -30; tail -14 $OUT/a16.log
