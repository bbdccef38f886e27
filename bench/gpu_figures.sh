#!/usr/bin/env bash
# Every figure of the GPU targets in one command, on one GPU:
#
#   bash bench/gpu_figures.sh [--wheelhouse DIR] [OUT [WORKLOAD ...]]
#
# With --wheelhouse, first installs the project from DIR with no package index
# (`./install.sh --wheelhouse DIR`). Logs and a summary go to OUT (default: ./gpu-figures).
# WORKLOAD: gsm8k-1.5b and/or gsm8k-0.5b (default: both, in that order: the 1.5 B run and the update
# pass after it take every figure still open, so a call whose budget ends later has them all). The first
# rollout of each compiles the decode step (about 50 s for 0.5 B on an H200), so each workload has 300 s
# (RRL_FIGURE_TIMEOUT=SECONDS changes that). RRL_FIGURES_BUDGET=SECONDS bounds the whole command
# (default 480: eight minutes, within a GPU session's device time; 0: no bound): each part's limit is
# cut to what is left of it (a part takes up to its whole limit of what is left). In this order:
#   1. the first workload (gsm8k-1.5b by default): update, log-prob and whole-step MFU (the
#      project's count and verl's), end-to-end tokens/s/GPU, whether the gradients were finite,
#      decode compiles and graph breaks, the engine's prefill and decode-loop time in each step, the
#      packed attention each rank took, one actor SIGKILL's recovery time (its phases, and each
#      role's rebuild), then the rollout engine alone on the run's rollout model, with its share of
#      the decode roofline: the engine loads the run's kept decode step, so it compiles nothing;
#   2. bench/update_mfu.py: the update pass of 1.5 B alone (the size of the update target) on rows
#      of 512 to 1,536 tokens: its MFU by both counts and where the device's time goes (by kind of
#      work, the heaviest copies and elementwise operators at their shapes, the idle time by phase
#      of the update; its trace in OUT/update_trace.json.gz), then the same with the norms, rotary and SwiGLU
#      eager (compiled by default on a GPU) and with every block compiled;
#   3. what no target needs, with what is left: bench/gpu_release.py: how long a SIGKILLed
#      process's 32 GiB stay held on the GPU after its reap (a spare's build waits for them), against
#      the process freeing them itself; bench/snapshot_restore.py: a restore's writing of the 0.5 B
#      actor's state from pageable memory, directly and through page-locked staging buffers;
#      bench/fused_elementwise.py: a block's norms, rotary embedding and SwiGLU, eager against compiled;
#   4. the other workloads: gsm8k-0.5b is the same as 1, with the engine against HF generate
#      (dynamic cache; 9.66x on an H200, 2026-11-30) on the same batch.
# The components have their own commands, each measured on an H200 (docs/performance.md):
# `python bench/sampling.py --rows 512` (the decode step's sampling pass), `python bench/varlen.py
# --device cuda` (the packed-attention backends), `python bench/logprob.py --shape qwen2.5-1.5b
# --head-rows 443 --head-chunks 16` (the log-prob head) and `python bench/decode_profile.py
# --workload gsm8k-0.5b --rows 512` (the decode step's kernels). On an H200 (2026-11-30) the
# install took 23 s and the 0.5 B workload about 5 minutes with a comparison that compiled the
# decode step again and timed HF's dynamic cache twice (121 s of it; neither is done now).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--wheelhouse" ]; then
    ./install.sh --wheelhouse "${2:?--wheelhouse needs a folder}" || exit 1
    shift 2
fi
out="${1:-${OUT:-gpu-figures}}"
[ $# -gt 0 ] && shift
workloads=("$@")
[ ${#workloads[@]} -gt 0 ] || workloads=(gsm8k-1.5b gsm8k-0.5b)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
PY="$(command -v python || command -v python3)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
"$PY" -c "import torch, transformers, ray; print('torch', torch.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__)" | tee -a "$out/gpu.txt"
status=0
limit="${RRL_FIGURE_TIMEOUT:-300}"
budget="${RRL_FIGURES_BUDGET:-480}"
within() {  # a part's limit in seconds, cut to what is left of the budget (SIGKILL comes 20 s after the limit)
    local want=$1
    if [ "$budget" -gt 0 ]; then
        local left=$(( budget - SECONDS - 25 ))
        [ "$left" -lt "$want" ] && want=$left
        [ "$want" -lt 5 ] && want=5
    fi
    echo "$want"
}
run() {  # name, timeout, arguments of bench/gpu.py
    local name=$1 limit=$2
    shift 2
    echo "== $name: python bench/gpu.py $*" | tee -a "$out/summary.txt"
    # SIGTERM first (the run stops where it is and reports its steps so far, rc 124), SIGKILL 20 s
    # later: a run never outlasts its limit much.
    timeout -k 20 "$limit" "$PY" bench/gpu.py "$@" > "$out/$name.log" 2>&1
    local rc=$?
    # The stamped lines ("[  12.3 s] step 2: ...") are printed as the run goes: a run stopped at its
    # limit still leaves its steps, its recovery events and the figures of its measured steps so far.
    grep -E "^(workload|  |tokens/s|MFU|decode step|log-prob head|(actor|critic)'s norms|recovery|steps in|generation|GPU [0-9]|first checkpoint|warm-up|\[ *[0-9.]+ s\])|memory plan:|packed attention:" \
        "$out/$name.log" | tee -a "$out/summary.txt"
    echo "rc=$rc" | tee -a "$out/summary.txt"
    [ $rc = 0 ] || { status=1; tail -30 "$out/$name.log"; }
}
workload() {  # one workload of bench/gpu.py, its limit cut to what is left of the budget
    local w=$1 wlimit
    wlimit=$(within "$limit")
    case "$w" in
        gsm8k-0.5b) run "$w" "$wlimit" --workload "$w" --warmup 1 --steps 2 --generation-paths engine,hf_dynamic ;;
        gsm8k-1.5b) run "$w" "$wlimit" --workload "$w" --warmup 1 --steps 2 --generation-paths engine ;;
        *) echo "gpu_figures.sh: unknown workload $w (gsm8k-0.5b, gsm8k-1.5b)" >&2; status=2 ;;
    esac
}
part() {  # name, limit in seconds, lines of its log for the summary, then the script and its arguments
    local name=$1 want=$2 lines=$3
    shift 3
    echo "== python $*" | tee -a "$out/summary.txt"
    timeout -k 10 "$(within "$want")" "$PY" "$@" > "$out/$name.log" 2>&1
    echo "rc=$?" >> "$out/$name.log"
    grep -vE "^(W[0-9]{4}|USDT)" "$out/$name.log" | tail -"$lines" | tee -a "$out/summary.txt"
}
# The first workload first: alone it takes every figure still open but the update pass's MFU, next.
workload "${workloads[0]}"
# The update pass of 1.5 B alone, rows of 512-1,536 tokens: MFU and a profile, then with the norms and
# SwiGLU eager (what the compiled ones save on the whole update), then with every
# block compiled (on an H200 1.30x slower while each block broke at its packed attention; now one
# graph a block, where inductor can fuse the elementwise third). The eager head variant was 1.39x
# slower (docs/performance.md); `--variant NAME=KEY=VALUE` times one again. It prints its figures
# as it goes: a limit that ends it during the variant leaves the workload's own.
part update_mfu 200 75 bench/update_mfu.py --workload gsm8k-1.5b --rows 32 --repeats 2 \
    --trace "$out/update_trace.json.gz" --variant eager_elementwise=actor.compile_elementwise=false \
    --variant compiled_blocks=actor.compile=true
# How long a killed process's GPU memory stays held after the process is reaped: the window in which a
# warm spare's first build finds the dead rank's GPU still full (resilient_rl/workers/held_memory.py).
part gpu_release 40 3 bench/gpu_release.py --gib 32 --repeats 2
# A restore's writing of the 0.5 B actor's state (6 GB) from pageable memory, as a rank that replaces a
# killed one reads its node copy: directly, through two page-locked buffers (what a restore does now),
# and from page-locked memory.
part snapshot_restore 60 6 bench/snapshot_restore.py --device cuda
# A block's norms, rotary embedding and SwiGLU at a 1.5 B micro-batch, eager (Hugging Face's module, F.rms_norm) against
# compiled (the default on a GPU): about 220 of the 445 KB a token and layer the eager update wrote
# outside its products were the norms' fp32 intermediates (bench/activation_bytes.py).
part fused_elementwise 60 18 bench/fused_elementwise.py --device cuda
for w in "${workloads[@]:1}"; do
    workload "$w"
done
exit $status
