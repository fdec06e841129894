#!/usr/bin/env bash
# GPU check of the measurement stack (issue #4): strategies side by side, bf16, one process
# per model, tables and plots written under $OUT (default ./outputs/gpu_check).
#   bash scripts/gpu_check.sh                    # on a CUDA machine: the real sizes (< 6 min, H200)
#   GPU_CHECK_SMALL=1 bash scripts/gpu_check.sh  # tiny sizes on CPU (what the test runs)
# Real sizes: U-Net ResNet-34 at 1024 px, batch 8; GPT (gpt_small, 16 blocks, width 256) at
# the longest sequence, batch 1, whose `none` step the estimator (remat.estimate, CUDA)
# predicts to fit in 80% of the GPU's memory, tried from 4096 tokens doubling up to 131072,
# benchmarked at that length and a quarter of it. Then the planner (issue #11): three plans
# of the U-Net for budgets between its floor and none's peak, planned for this device,
# predicted against measured peak and step time (scripts/gpu_plan_check.py, plans.md/.json).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-outputs/gpu_check}
mkdir -p "$OUT"
SMALL=${GPU_CHECK_SMALL:-0}
if [ "$SMALL" != 1 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device; running the small CPU sizes (set GPU_CHECK_SMALL=1 to silence)"
  SMALL=1
fi
if [ "$SMALL" = 1 ]; then
  UNET=(model=unet_resnet18 data.image_size=64 data.batch_size=1 device=cpu warmup=0 steps=1
        'model.arch_kwargs.decoder_channels=[16,16,8,8,8]')
  GPT=(model=gpt_tiny data.batch_size=1 device=cpu warmup=0 steps=1)
  SEQ_START=32; SEQ_MAX=128; FRACTION=0.8; DEVICE=cpu
  PLAN=(model=unet_resnet18 data.image_size=128 data.batch_size=2 --steps 2 --warmup 1)
else
  UNET=(model=unet_resnet34 data.image_size=1024 data.batch_size=8 device=cuda)
  GPT=(model=gpt_small data.batch_size=1 device=cuda)
  SEQ_START=4096; SEQ_MAX=131072; FRACTION=0.8; DEVICE=cuda
  PLAN=(model=unet_resnet34 data.image_size=1024 data.batch_size=8 precision=bf16-mixed)
fi
STRATS='strategies=[none,full,sqrtn,{name: selective, policy: matmul},{name: offload, segments: sqrtn}]'

"$PY" - "$OUT" <<PYEOF
import json, sys, torch
from remat.measure import device_name
info = {"device": device_name("$DEVICE"), "torch": torch.__version__,
        "cuda": torch.version.cuda, "small": "$SMALL" == "1"}
open(sys.argv[1] + "/device.json", "w").write(json.dumps(info, indent=2))
print("gpu_check on", info)
PYEOF

echo "== U-Net, bf16"
"$PY" -m remat.bench "${UNET[@]}" precision=bf16-mixed "$STRATS" hydra.run.dir="$OUT/unet" \
  | tee "$OUT/unet.txt"

echo "== GPT: longest sequence whose none step fits (estimated)"
LONGEST=$("$PY" - <<PYEOF
import torch
from hydra import compose, initialize_config_dir
from remat.config import config_dir
from remat.estimate import estimate
if "$DEVICE" == "cuda":
    budget = $FRACTION * torch.cuda.get_device_properties(0).total_memory
else:  # CPU: a fixed small budget in bytes, scaled like the GPU's 80%
    budget = 16 * 2**20
best, size = None, $SEQ_START
with initialize_config_dir(version_base="1.3", config_dir=str(config_dir())):
    while size <= $SEQ_MAX:
        cfg = compose("estimate", overrides=["${GPT[0]}", "data.batch_size=1",
                                             f"+data.block_size={size}", "device=$DEVICE",
                                             "precision=bf16-mixed", "paths.output_dir=/tmp"])
        peak = estimate(cfg).peak_bytes
        import sys; print(f"  {size} tokens: estimated {peak / 2**20:.0f} MiB", file=sys.stderr)
        if peak > budget:
            break
        best, size = size, size * 2
print(best or $SEQ_START)
PYEOF
)
echo "longest block_size: $LONGEST"
QUARTER=$(( LONGEST / 4 > 0 ? LONGEST / 4 : 1 ))
"$PY" -m remat.bench "${GPT[@]}" precision=bf16-mixed "$STRATS" "data.block_size=[$QUARTER,$LONGEST]" \
  hydra.run.dir="$OUT/gpt" | tee "$OUT/gpt.txt"

echo "== planner: three plans on this device, predicted vs measured"
"$PY" scripts/gpu_plan_check.py "${PLAN[@]}" --out "$OUT/plans.md"
echo "gpu_check: tables in $OUT/unet.txt, $OUT/gpt.txt, $OUT/plans.md (csv/json/png under $OUT/unet, $OUT/gpt)"
