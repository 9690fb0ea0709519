source .device/device-env.sh
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv > $OUT/smi.txt
timeout 150 python -m benchmarks.grouped --fp8 --quick --no-triton --name grouped_fp8_routed > $OUT/grouped.log 2>&1; echo "grouped rc $?" >> $OUT/grouped.log
cp benchmarks/results/grouped_fp8_routed_h200.json $OUT/ 2>/dev/null
timeout 330 python benchmarks/attention.py --decode --no-flex --fp8 --name attention_decode_full > $OUT/decode.log 2>&1; echo "decode rc $?" >> $OUT/decode.log
cp benchmarks/results/attention_decode_full_h200.* $OUT/ 2>/dev/null
tail -12 $OUT/grouped.log; tail -30 $OUT/decode.log
