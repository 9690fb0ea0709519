source .device/device-env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
timeout 100 python -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/gpu/test_scaled_a16_gpu.py -k "prefetch or shuffled_layout_variants" > $OUT/a16_tests.log 2>&1; echo "rc $?" >> $OUT/a16_tests.log; tail -3 $OUT/a16_tests.log
timeout 120 python -m benchmarks.scaled --a16 --quick --a16-m 1 4 16 --a16-variants bits_ahead prefetch1 prefetch2 bits_ahead_prefetch1 bits_ahead_prefetch2 --name scaled_mxfp4_a16_prefetch > $OUT/a16.log 2>&1; echo "rc $?" >> $OUT/a16.log
cp benchmarks/results/scaled_mxfp4_a16_prefetch_h200.json $OUT/
timeout 120 python benchmarks/attention.py --decode --quick --models llama70b minimax --sq 8 --no-flex --decode-variants rows16 warp32 --name attention_decode_rows64 > $OUT/rows64.log 2>&1; echo "rc $?" >> $OUT/rows64.log
timeout 120 python benchmarks/attention.py --decode --quick --models llama70b minimax --sq 8 --no-flex --fp8 --decode-variants rows16 warp16 --name attention_decode_rows64_fp8 > $OUT/rows64_fp8.log 2>&1; echo "rc $?" >> $OUT/rows64_fp8.log
cp benchmarks/results/attention_decode_rows64*_h200.json $OUT/
python scratch/ncu_probe.py mm_fp8 > $OUT/probe.log 2>&1; python scratch/ncu_probe.py mm_fp8_paged16 >> $OUT/probe.log 2>&1
source scratch/ncu.sh
run mm_fp8 attention_decode
run mm_fp8_paged16 attention_decode
tail -14 $OUT/a16.log
grep -h "TB/s\|rc \|geomean" $OUT/rows64*.log | tail -20; cat $OUT/probe.log | tail -4
for f in $OUT/ncu_mm*.txt; do echo == $f; grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|No Eligible|L2 Hit" $f | head -12; done
