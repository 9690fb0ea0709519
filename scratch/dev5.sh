source .device/device-env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
timeout 200 python benchmarks/models.py --quick --cases spec-decode llama-decode minimax-decode > $OUT/models.log 2>&1; echo "rc $?" >> $OUT/models.log
cp benchmarks/results/models_h200.json $OUT/models_routing_h200.json 2>/dev/null
grep -E "x[0-9]|rc " $OUT/models.log | tail -20
