source .device/device-env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
which g++ ninja; python -c "import sysconfig,os;p=sysconfig.get_paths()['include'];print(p, os.path.exists(p+'/Python.h'))"
python - <<'PY' 2>&1 | tail -3
import time, logging; logging.basicConfig(level=logging.INFO)
t=time.time()
from nvfly.torch import native_routes
print("native", native_routes.module(), time.time()-t)
PY
timeout 150 python scratch/hopcost.py 12 > $OUT/hopcost.log 2>&1; echo "rc $?" >> $OUT/hopcost.log; grep -E "us a step|rc|rror" $OUT/hopcost.log
for run in native py; do
  if [ $run = py ]; then export NVFLY_ROUTING_NATIVE=0; fi
  timeout 200 python benchmarks/models.py --quick --cases minimax-decode llama-decode spec-decode > $OUT/models_$run.log 2>&1; echo "rc $?" >> $OUT/models_$run.log
  cp benchmarks/results/models_h200.json $OUT/models_$run.json 2>/dev/null
  grep -E "x[0-9]|rc " $OUT/models_$run.log | cut -c1-150 | tail -12
done
