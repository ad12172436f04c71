#!/usr/bin/env bash
# What a session on a remote GPU machine runs, for a copy of this tree on a machine that has torch, triton,
# pandas, matplotlib and pytest but no network. Python wheels that machine lacks (Liger-Kernel for its peers;
# nbclient, nbformat and ipykernel for the notebooks) go in .whl/ beside the tree and are installed into
# /tmp/site. Set KLDIV_INLINE_COMMIT to the commit the tree holds, as a literal taken where the real .git is (a
# copied .git may be stale, so `$(git rev-parse HEAD)` run on the copy can name the wrong commit): results record it.
#   tools/gpu_session.sh test      # PYTHON=python3 make test: every test, the gpu-marked ones included
#   tools/gpu_session.sh results   # PYTHON=python3 make results: check, bench, plot into results/ (RESUME=1: the
#                                  #   bench that a time limit cut short finished by bench --resume, then plot)
#   tools/gpu_session.sh notebooks # execute every notebook at full size, executed copies to $OUT (or /tmp); without
#                                  #   Jupyter there, each twin as a script (tools/run_notebook_twin.py), logs to $OUT
#   tools/gpu_session.sh sweep     # the fused LM head at 1k-16k tokens -> ${RESULTS:-results}/linear-sweep/<card>/
#                                  #   (RESUME=1: finish that folder's run, which a time limit cut short)
#   tools/gpu_session.sh errors    # the kit's modules raise their errors (each call in a process of its own)
#   tools/gpu_session.sh split     # two GPUs: the split step profiled against one GPU, forward KL and the JSD
#   tools/gpu_session.sh topk      # two GPUs: the same with the teacher's top 100 log-probabilities (time, memory)
#   tools/gpu_session.sh graph     # two GPUs: the two-GPU tests (a captured split step among them), then the split
#                                  #   step captured in a CUDA graph at full size, timed against eager
#   tools/gpu_session.sh accuracy  # two GPUs: the split's float32 gradients against float64 beside one process's
#                                  #   (tools/probe_split_accuracy.py), with kernels/ and with kNormDoubleSums off
#   tools/gpu_session.sh profile   # Nsight Compute of the training rows' fast_rows launches in distill_probe.py
#                                  #   --once (forward KL's, the JSD's; its forward alone takes stream_forward_kernel)
#                                  #   and the top-k teacher's fast_topk_kernel launch: stall reasons and
#                                  #   instructions per SASS line -> ${OUT:-/tmp}/fast_rows_*.csv
#   tools/gpu_session.sh kept-offset  # kJsdKeptUsOffset switched off in a copy of kernels/: the JSD's bfloat16
#                                  #   gradients of both against float64 (tools/probe_kept_us.py), the tests that
#                                  #   bound them over 3 draws, tools/distill_trees.py the copy against kernels/
#                                  #   (with --near 0.3: rows summed again) (kernels/NOTES.md, versions 53-54)
#   tools/gpu_session.sh against OLD  # a change to kernels/ checked on the GPU against OLD (a kernels/ directory,
#                                  #   e.g. `git archive REV kernels | tar -x -C old`, carried with the tree): the
#                                  #   two trees' outputs bit for bit (tools/trees_agree.py, bf16 and float32), their
#                                  #   steps timed (tools/distill_trees.py), then the gpu-marked distillation tests
#                                  #   (the fused head's and the split's too; the two-GPU ones skip on one GPU)
#   tools/gpu_session.sh teacher-accuracy  # one GPU: the JSD's float32 teacher gradient on a group of one rank
#                                  #   (tools/probe_split_teacher_accuracy.py, 30 draws; kernels/NOTES.md, version
#                                  #   66), then the gpu-marked teacher-gradient tests and the split's group of one
#   tools/gpu_session.sh host-paths  # one GPU: the gpu-marked tests of the host-side paths changed without a GPU:
#                                  #   the harness (test_harness; its two-GPU case skips on one), the KL op (test_ops,
#                                  #   test_ops_reliability: float16's gradient folded in backward, torch.compile),
#                                  #   the distillation's compiled op, opcheck, batched backward, inference-mode teachers
#                                  #   and float32 lanes' refusals, negative views, refilled teachers, masked tokens'
#                                  #   grad_output; the fused head's inference-mode, autocast, compile, opcheck,
#                                  #   negative grad_output and in-place tests; the harness's second look at
#                                  #   integral outputs (CUDA)
#   tools/gpu_session.sh x2        # two GPUs: the two-GPU tests, then the committed run of the split
#                                  #   (bench_vocab_parallel --reps 10 --warmup 3 --graph) -> ${RESULTS:-results}/<card>-x2/
# Two GPUs: NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --standalone --nproc-per-node 2 \
#   tools/bench_vocab_parallel.py    # the vocabulary split across GPUs -> results/<card>-x2/
set -euo pipefail
mode=${1:?test|results|notebooks|sweep|errors|split|topk|graph|accuracy|teacher-accuracy|host-paths|profile|kept-offset|against|x2}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
case $mode in
  test) PYTHON=python3 make test PYTEST_ARGS="${PYTEST_ARGS:--q -x}" ;;
  results)
    if [ -n "${RESUME:-}" ]; then python3 -m kldiv_inline bench --resume && python3 -m kldiv_inline plot
    else PYTHON=python3 make results; fi ;;
  sweep) python3 -m kldiv_inline bench --suites linear --linear-sweep --reps 5 --results "${RESULTS:-results}/linear-sweep" \
           ${RESUME:+--resume} ;;
  errors) python3 tools/check_module_errors.py ;;
  split)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    for beta in 0 0.5; do
      torchrun --standalone --nproc-per-node 2 tools/profile_vocab_parallel.py --beta "$beta"
    done ;;
  topk)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    torchrun --standalone --nproc-per-node 2 tools/profile_vocab_parallel.py --topk 100 ;;
  graph)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    python3 -m pytest -q tests/test_vocab_parallel.py -k gpus
    torchrun --standalone --nproc-per-node 2 tools/probe_split_graph.py ;;
  accuracy)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    off=$(mktemp -d) && cp -r kernels "$off/"
    sed -i 's/constexpr bool kNormDoubleSums = true;/constexpr bool kNormDoubleSums = false;/' "$off/kernels/distill_fast.cuh"
    grep -q "kNormDoubleSums = false" "$off/kernels/distill_fast.cuh"
    torchrun --standalone --nproc-per-node 2 tools/probe_split_accuracy.py
    KLDIV_INLINE_KERNELS="$off/kernels" torchrun --standalone --nproc-per-node 2 tools/probe_split_accuracy.py
    python3 -m pytest -q -m gpu tests/test_vocab_parallel.py ;;
  profile)
    out=${OUT:-/tmp}
    # --clock-control none: the clocks as the timings saw them; one launch each of 4096 x 128256 bf16, T = 2
    ncu --clock-control none -k "regex:fast_rows_kernel|fast_topk_kernel" -c 3 --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section SchedulerStats --section WarpStateStats --section SourceCounters \
      -f -o "$out/fast_rows" python3 tools/distill_probe.py --once --no-peers
    ncu -i "$out/fast_rows.ncu-rep" --page details --csv > "$out/fast_rows_details.csv"
    ncu -i "$out/fast_rows.ncu-rep" --page source --print-source sass --csv > "$out/fast_rows_source.csv" ;;
  kept-offset)
    off=$(mktemp -d) && cp -r kernels "$off/"
    sed -i 's/constexpr bool kJsdKeptUsOffset = true;/constexpr bool kJsdKeptUsOffset = false;/' "$off/kernels/distill_fast.cuh"
    grep -q "kJsdKeptUsOffset = false" "$off/kernels/distill_fast.cuh"
    KLDIV_INLINE_KERNELS="$off/kernels" python3 -c "import kldiv_inline as K; K.load('cuda', extension='distill')" &
    python3 -c "import kldiv_inline as K; K.load('cuda', extension='distill')" & wait
    python3 tools/probe_kept_us.py "$off/kernels" kernels --draws 10
    for i in 1 2 3; do
      python3 -m pytest -q -m gpu tests/test_distill.py -k "far_from_zero or nearly_agree" | tail -1 || true
    done
    python3 tools/distill_trees.py "$off/kernels" kernels --rounds 2
    python3 tools/distill_trees.py "$off/kernels" kernels --rounds 1 --near 0.3 ;;
  against)
    old=${2:?against OLD: the kernels/ directory to compare with}
    for dtype in bfloat16 float32; do python3 tools/trees_agree.py "$old" kernels --dtype "$dtype"; done
    python3 tools/distill_trees.py "$old" kernels --rounds 2 --spreads 3 2
    python3 -m pytest -q -m gpu tests/test_distill.py tests/test_fused_linear.py tests/test_vocab_parallel.py ;;
  teacher-accuracy)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    python3 tools/probe_split_teacher_accuracy.py --draws 30
    python3 -m pytest -q -m gpu tests/test_distill.py -k teacher
    # the seed at which the group of one rank's teacher gradient was last seen outside its bound
    KLDIV_TEST_SEED=3533313995 python3 -m pytest -q tests/test_vocab_parallel.py::test_one_gpu_group_of_one_rank ;;
  host-paths)
    python3 -m pytest -q -m gpu tests/test_harness.py tests/test_ops.py tests/test_ops_reliability.py
    python3 -m pytest -q -m gpu tests/test_distill.py \
      -k "compile or opcheck or batched_backward or inference_mode or float32_lanes or negative or refilled or whatever_their"
    python3 -m pytest -q -m gpu tests/test_fused_linear.py -k "inference_mode or autocast or compile or opcheck or negative or refilled or in_place_before" ;;
  x2)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    python3 -m pytest -q -x -m gpu tests/test_vocab_parallel.py
    torchrun --standalone --nproc-per-node 2 tools/bench_vocab_parallel.py --reps 10 --warmup 3 --graph \
      --results "${RESULTS:-results}" ;;
  notebooks)
    if ! python3 -c "import nbclient, nbformat, ipykernel" 2>/dev/null; then
      # no Jupyter here: each notebook's jupytext twin as a script (every cell, the study's sizes; no outputs kept);
      # every notebook runs, and the exit status says whether one failed
      out=$(realpath -m "${OUT:-/tmp}"); mkdir -p "$out"; fails=0
      cd notebooks
      for nb in 0*.py; do
        t0=$(date +%s); rc=0; python3 ../tools/run_notebook_twin.py "$nb" > "$out/${nb%.py}.log" 2>&1 || rc=$?
        echo "$nb: rc $rc in $(( $(date +%s) - t0 )) s -> $out/${nb%.py}.log"; [ "$rc" -eq 0 ] || fails=1
      done
      exit $fails
    fi
    for nb in notebooks/0*.ipynb; do
      python3 - "$nb" <<'PY'
import sys, time, nbformat
from nbclient import NotebookClient
from pathlib import Path
path = Path(sys.argv[1]); t0 = time.time()
nb = nbformat.read(path, as_version=4)
NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
out = Path(__import__("os").environ.get("OUT", "/tmp")) / path.name
nbformat.write(nb, out)
print(f"{path.name}: ran in {time.time() - t0:.0f} s -> {out}")
PY
    done ;;
esac
