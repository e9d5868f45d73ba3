# Session C, run 2: in parallel on the one GPU (each eval writes its results after every method): the rotated cache's
# bf16 test on CUDA; KVQuant (artifact carried, made on the CPU) and rotated-3 / -2 at P=6144 on run a3's 64 windows;
# every preset at P=1024 on the 16 windows of the CPU reference through the kernels (triton) and the GPU reference
# (torch, in three parts), for the paired agreement of the two backends; retrieval (multi-key, multi-value, variable
# tracking at 2k / 4k / 8k, 50 prompts a cell, one generate a cell) in four parts.
set -o pipefail
. results/eval__h200__decode-protocol__20261202/setup.sh
export OMP_NUM_THREADS=2
ALL="exact fp8-e4m3 fp8-e5m2 int8 int4-g32 int4-g64 int2-g32 kivi-4 kivi-2 kvquant-4 kvquant-3 kvquant-2 rotated-4
 rotated-3 rotated-2 turboquant-4 turboquant-3.5 turboquant-3 turboquant-2.75 turboquant-2.5"
ev() { name=$1; t=$2; shift 2; s=$(date +%s); timeout $t python3 -m hf_kvcache.cli eval --no-passkey --no-progress --out /tmp/res/$name "$@" > /tmp/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s) - s ))s"; }
mkdir -p /tmp/res
( timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore tests/methods/test_rotated.py -k bf16 > /tmp/rotated_bf16.log 2>&1; echo "== rotated_bf16: $(tail -1 /tmp/rotated_bf16.log)" ) &
ev p6144 400 --methods kvquant-4 kvquant-3 kvquant-2 rotated-3 rotated-2 --prefill 6144 --windows 64 &
ev p1024_triton 500 --methods $ALL --prefill 1024 --windows 16 --backend triton &
ev p1024_torch_a 520 --methods exact fp8-e4m3 fp8-e5m2 int8 int4-g32 int4-g64 int2-g32 --prefill 1024 --windows 16 --backend torch &
ev p1024_torch_b 520 --methods kivi-4 kivi-2 kvquant-4 kvquant-3 kvquant-2 rotated-4 rotated-3 --prefill 1024 --windows 16 --backend torch &
ev p1024_torch_c 520 --methods rotated-2 turboquant-4 turboquant-3.5 turboquant-3 turboquant-2.75 turboquant-2.5 --prefill 1024 --windows 16 --backend torch &
R="--protocol decode --prefill 16 --decode-tokens 1 --windows 1 --retrieval all --retrieval-samples 50 --retrieval-batch 50"
ev ret_a 520 --methods fp8-e4m3 int4-g32 kvquant-4 $R &
ev ret_b 520 --methods kivi-4 kivi-2 int8 $R &
ev ret_c 520 --methods rotated-4 turboquant-4 $R &
ev ret_d 520 --methods turboquant-3 turboquant-2.5 $R &
wait
for f in /tmp/p*.log /tmp/ret_*.log; do echo "## $f"; grep -v -i "warn\|^$\|^  \|it/s\]\|reminder" $f; done > $OUT/c2_evals.log
tail -3 /tmp/rotated_bf16.log >> $OUT/c2_evals.log
tar czf $OUT/c2_results.tgz -C /tmp/res .
grep -h "rc=\|^|" $OUT/c2_evals.log | head -0; tail -c 6000 $OUT/c2_evals.log
