#!/usr/bin/env bash
# One sitting's GPU checks, in two parts that each end within ten minutes on an H100 or H200:
#
#   bash benchmarks/gpu_sitting.sh engine OUT   # the device and versions, tests/gpu, a 256-row decode step and a
#                                               # mixed one (investigations/cuda_step.py), the engine at both model sizes
#                                               # (cuda_engine.py: graphs on and off)
#   bash benchmarks/gpu_sitting.sh serve OUT    # configs/serve-gpu.yaml on the SmolLM2-shaped model, a burst of 256
#                                               # with one ingress replica and with four on the shared port,
#                                               # each against the offline engine (both engines' steps by kind:
#                                               # decode-only, in graphs, with their rows, the others, and
#                                               # those launched ahead)
#
# A task's device time (15 minutes, the machine's start included) fits one part a sitting: the engine part first.
# Run from the repository root. GPU_PY: a python whose torch is a CUDA build (default python3, a GPU image's).
# GPU_SITE: on an image that lacks Ray Serve or the engine's dependencies and reaches no registry, the archive of
# `make gpu-site` (made elsewhere, carried here), unpacked and put first on PYTHONPATH. Each command has a time
# limit of its own, so one that hangs costs its limit and the others still run. Everything goes into one
# archive, OUT/<part>.tgz (logs, JSON results, the environment), as few files as a device's transfer allows.
set -uo pipefail
part=${1:?engine or serve}
out=${2:?OUT folder}
py=${GPU_PY:-python3}
work=$(mktemp -d)
mkdir -p "$out"

if [ -n "${GPU_SITE:-}" ]; then
    mkdir "$work/site" && tar xJf "$GPU_SITE" -C "$work/site" && export PYTHONPATH=$work/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 RAY_TMPDIR=$work/ray

# run NAME LIMIT_S COMMAND...: the command's output in NAME.log, its exit status and seconds in summary.txt
run() {
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout --kill-after=10 "$limit" "$@" >"$work/$name.log" 2>&1
    local rc=$?
    printf '%-28s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - start))" | tee -a "$work/summary.txt"
}

{
    date -u
    git rev-parse HEAD 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    $py -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
triton.__version__)"
    $py -c "import transformers, ray; print('transformers', transformers.__version__, 'ray', ray.__version__)"
    lscpu | grep -E '^(Model name|CPU\(s\))'
    $py -c "from benchmarks.quantization import cpu_features; print(cpu_features())"
} >"$work/environment.txt" 2>&1

case $part in
engine)
    run tests_gpu 300 $py -m pytest -q -p no:cacheprovider -m gpu tests/gpu
    run cuda_step_256 120 $py benchmarks/investigations/cuda_step.py --models smollm2-135m --rows 256 \
        --json "$work/cuda_step_135m_256rows.json"
    run cuda_step_255_prefill128 120 $py benchmarks/investigations/cuda_step.py --models smollm2-135m --rows 255 --prefill 128 \
        --json "$work/cuda_step_135m_255rows_prefill128.json"
    run cuda_step_1b 90 $py benchmarks/investigations/cuda_step.py --models llama-1b --json "$work/cuda_step_1b.json"
    run cuda_engine 240 $py benchmarks/cuda_engine.py --models smollm2-135m,llama-1b \
        --configs triton-graphs,triton-eager --repeats 1 --json "$work/cuda_engine.json"
    ;;
serve)
    run serve_configs 120 $py - "$work" <<'EOF'
import sys
import torch
import yaml
sys.path.insert(0, ".")
from benchmarks.cuda_engine import SHAPES, shaped_model
work = sys.argv[1]
model = shaped_model(f"{work}/model", SHAPES["smollm2-135m"], device="cuda", dtype=torch.bfloat16)
for replicas in (1, 4):
    with open("configs/serve-gpu.yaml") as f:
        config = yaml.safe_load(f)
    args = config["applications"][0]["args"]
    args["engine"]["model"] = model
    args["ingress"] = dict(num_replicas=replicas)
    with open(f"{work}/serve_ingress{replicas}.yaml", "w") as f:
        yaml.safe_dump(config, f)
EOF
    for replicas in 1 4; do
        run "serve_ingress$replicas" 240 $py benchmarks/serve_bench.py --launch --config "$work/serve_ingress$replicas.yaml" \
            --compare-offline --num-requests 256 --json "$work/serve_ingress$replicas.json"
    done
    rm -rf "$work/model"
    ;;
*)
    echo "unknown part: $part (engine or serve)" >&2
    exit 2
    ;;
esac

rm -rf "$work/ray"
tar czf "$out/$part.tgz" -C "$work" .
cat "$work/summary.txt"
