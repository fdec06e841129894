"""Real subprocess runs of the entry points, as a user types them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_python

REPO = Path(__file__).resolve().parents[1]
FAST = ["data.image_size=64", "data.num_train=8", "data.num_val=4", "trainer.accelerator=cpu",
        "callbacks=minimal", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false"]


@pytest.mark.slow  # > 5 s on 2 cores and not the only proof: make test-all
def test_module_entry_point_is_the_same_app(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_python(["-m", "remat.train", "strategy=full", "trainer.max_steps=1", *FAST,
                 f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy"] == "full" and summary["global_step"] == 1


@pytest.mark.slow  # train.py starts, 7-10 s each; its one-line error: tests/test_errors.py
@pytest.mark.parametrize("override,expected", [
    ("strategy=sqrt", "Available options in 'strategy'"),
    # the message itself is also checked in process (tests/test_train.py)
    ("accumulate_grad_batches=0", "accumulate_grad_batches must be an integer >= 1"),
])
def test_bad_command_line_fails_with_a_clear_message(tmp_path, override, expected):
    proc = run_python([str(REPO / "train.py"), override, *FAST,
                       f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path)
    assert proc.returncode != 0
    assert expected in proc.stderr


@pytest.mark.slow
def test_gpu_check_script_runs_small_on_cpu(tmp_path):
    """scripts/gpu_check.sh with GPU_CHECK_SMALL=1: both benchmarks and the planner's three
    plans, tables under $OUT (about 3 min on 2 shared cores)."""
    env = dict(os.environ, OUT=str(tmp_path / "out"), GPU_CHECK_SMALL="1",
               PYTHON=sys.executable, PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    unet = json.loads((out / "unet" / "bench.json").read_text())
    gpt = json.loads((out / "gpt" / "bench.json").read_text())
    assert unet["precision"] == gpt["precision"] == "bf16-mixed"
    assert gpt["sizes"] == [32, 128]  # SEQ_MAX=128 caps the doubling on CPU; a quarter of it
    assert all(r["grads_match"] for r in unet["rows"] + gpt["rows"])
    assert "grads match" in (out / "gpt.txt").read_text()
    plans = json.loads((out / "plans.json").read_text())
    assert [r["row"] for r in plans["rows"]][0] == "none" and len(plans["rows"]) == 4
    for row in plans["rows"]:  # planned for this CPU: kernel temporaries measured
        assert row["fits"] and row["grads_match"]
        assert abs(row["measured_over_predicted"] - 1) < 0.01, row
    assert "measured / predicted" in (out / "plans.md").read_text()


@pytest.mark.slow  # > 5 s on 2 cores and not the only proof: make test-all
def test_a_non_editable_install_finds_its_config_tree(tmp_path):
    """The wheel carries the Hydra config tree (``remat/configs/``): installed without the
    repository, the package composes its configs from inside itself."""
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-q",
                            "-w", str(wheels)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next(wheels.glob("remat-*.whl"))
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q",
                              "--target", str(target), str(wheel)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    code = ("import remat.config as c; from hydra import compose, initialize_config_dir; "
            "d = c.config_dir(); print(d); "
            "initialize_config_dir(version_base='1.3', config_dir=str(d)); "
            "print(compose('train', overrides=['strategy=sqrtn']).strategy._target_)")
    env = {k: v for k, v in os.environ.items() if k != "REMAT_CONFIG_DIR"}
    env["PYTHONPATH"] = str(target)  # ahead of the editable install of the repository
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, target_cls = proc.stdout.split()
    assert Path(where) == target / "remat" / "configs"
    assert target_cls == "remat.strategies.SqrtN"
