# ncu on the cases whose targets are missed: pipe utilisation, stalls, memory (appended to $OUT/ncu_<case>.txt)
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats"
run() {  # case kernel-regex
  timeout 150 ncu --clock-control none -k "regex:$2" --launch-skip 3 --launch-count 1 $SECTIONS \
    --metrics sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active,smsp__inst_executed_op_conversion.sum \
    python scratch/ncu_probe.py $1 > $OUT/ncu_$1.txt 2>&1
  echo "ncu $1 rc $?"
}
