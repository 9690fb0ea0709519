source .device/device-env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
export NVFLY_COMMIT=a215bd1
timeout -k 10 200 python -m pytest -q -n 4 -m gpu -p no:cacheprovider tests/gpu/test_attention_decode_wgmma_gpu.py tests/gpu/test_torch_attention_gpu.py tests/gpu/test_attention_decode_variants_gpu.py > $OUT/tests.log 2>&1; echo "rc $?" >> $OUT/tests.log; tail -3 $OUT/tests.log; grep -E "^(FAILED|ERROR)" $OUT/tests.log | head
timeout 200 python benchmarks/attention.py --decode --quick --sq 4 8 16 --fp8 --no-flex --no-mods --models llama8b minimax --decode-variants mma_sync combine_kernel --name attention_decode_wgmma_default > $OUT/bench.log 2>&1; echo "rc $?" >> $OUT/bench.log
cp benchmarks/results/attention_decode_wgmma_default_h200.json $OUT/ 2>/dev/null
grep -E "TB/s|rc " $OUT/bench.log | sed -E 's/ +cudnn.*//; s/err [0-9.e-]+ //' | cut -c1-170
timeout 100 python benchmarks/routing_overhead.py > $OUT/ro.log 2>&1; echo "rc $?" >> $OUT/ro.log; cp benchmarks/results/routing_overhead_h200.json $OUT/ 2>/dev/null; grep -E "^(sdpa|rms|mm|linear|topk|add|routing)|rc " $OUT/ro.log | cut -c1-150
timeout 100 python benchmarks/routing_overhead.py --profile --rounds 5 > $OUT/prof.log 2>&1; echo "rc $?" >> $OUT/prof.log; grep -E "==|host us|do_bench" $OUT/prof.log
export NVFLY_ROUTING_NATIVE=0
timeout 100 python benchmarks/routing_overhead.py --profile --rounds 5 > $OUT/prof_py.log 2>&1; echo "rc $?" >> $OUT/prof_py.log; grep -E "==|host us|do_bench" $OUT/prof_py.log
