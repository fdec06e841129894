"""Check ``python -m remat.estimate`` against the allocator on this CPU: for each strategy,
the tensor-level estimate and the estimate with ``kernel_temporaries=true`` (batch and each
operator's kernel temporaries) against the allocator peak of two real AdamW steps in
Lightning's order (``torch.profiler`` memory events, parameters and buffers included).

    python scripts/estimate_vs_allocator.py model=monai_swinunetr3d data.image_size=64 \
        data.batch_size=1 +data.num_classes=2 --strategies none,full,sqrtn

Any ``estimate``-config override is accepted; prints one CSV line per strategy (MiB).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_acceptance import allocator_peak  # noqa: E402

from remat.build import build_from_config  # noqa: E402
from remat.config import config_dir  # noqa: E402

MIB = 2**20


def _estimate(overrides: list[str]) -> dict:
    """``python -m remat.estimate device=cpu kernel_temporaries=true <overrides>`` as a user
    runs it; its ``estimate.json``."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "remat.estimate", "device=cpu",
                        "kernel_temporaries=true", *overrides, f"hydra.run.dir={tmp}"],
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads((Path(tmp) / "estimate.json").read_text())


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--strategies", default="none,full,sqrtn")
    args = parser.parse_args(argv)
    print("model,strategy,estimate (tensors),estimate (allocator),allocator measured,"
          "tensors / measured,allocator estimate / measured,optimizer state,parameters")
    for name in args.strategies.split(","):
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            cfg = compose("estimate", overrides=["device=cpu", f"strategy={name}",
                                                 "kernel_temporaries=true", *args.overrides])
        est = _estimate([f"strategy={name}", *args.overrides])
        build, _, batch, size = build_from_config(cfg)
        measured = allocator_peak(build.with_strategy, instantiate(cfg.strategy), batch, size,
                                  str(cfg.precision))
        cats, tensors, allocator = (est["categories"], est["peak_bytes"],
                                    est["allocator_peak_bytes"])
        print(f"{cfg.model.net._target_.rsplit('.', 1)[-1]},{name},"
              f"{tensors / MIB:.1f} MiB,{allocator / MIB:.1f} MiB,"
              f"{measured / MIB:.1f} MiB,{tensors / measured:.4f},"
              f"{allocator / measured:.4f},"
              f"{cats['optimizer_state'] / MIB:.1f} MiB,{cats['parameters'] / MIB:.1f} MiB",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
