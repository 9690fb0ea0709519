source .device/device-env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
export NVFLY_COMMIT=53f3606
timeout 400 python benchmarks/attention.py --decode --quick --sq 1 2 4 8 16 --no-flex --no-mods --decode-variants wgmma wgmma_combine_kernel --name attention_decode_wgmma_all > $OUT/wg_all.log 2>&1; echo "rc $?" >> $OUT/wg_all.log
cp benchmarks/results/attention_decode_wgmma_all_h200.json $OUT/ 2>/dev/null
grep -E "TB/s|rc " $OUT/wg_all.log | sed -E 's/\s+sdpa.*//' | cut -c1-200
