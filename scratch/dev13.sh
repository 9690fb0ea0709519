source .device/device-env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
timeout -k 5 140 python -m pytest -q -m gpu -n 8 -p no:cacheprovider --tb=line tests/gpu/test_routing_gpu.py tests/gpu/test_scaled_grouped_gpu.py tests/gpu/test_attention_decode_wgmma_gpu.py tests/gpu/test_attention_decode_gpu.py > $OUT/t.log 2>&1; echo "rc $?" >> $OUT/t.log; tail -3 $OUT/t.log; grep -E "^(FAILED|ERROR)" $OUT/t.log | head
