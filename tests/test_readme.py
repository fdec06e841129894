"""Every command in the README composes as written; the entry points run at tiny sizes.

The default run checks each ``python train.py``, ``python -m remat.<app>`` and ``remat-*``
command of the README's bash blocks against the real config tree (Hydra's own compose:
an unknown key, option or group fails), with ``<...>`` placeholders filled in and a
multirun's sweep lists taken at their first value. ``make`` targets are what CI itself runs;
``scripts/gpu_check.sh`` has its own slow test; ``remat.report`` reads a sweep folder
(``tests/test_report.py``). The slow test runs one command of each entry point for real,
with tiny sizes appended.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from remat.config import config_dir
from tests.helpers import run_python

README = Path(__file__).resolve().parents[1] / "README.md"
APPS = {"train.py": "train", "remat.train": "train", "remat-train": "train",
        "remat.bench": "bench", "remat-bench": "bench", "remat.estimate": "estimate",
        "remat-estimate": "estimate", "remat.eval": "eval", "remat-eval": "eval",
        "remat.plan": "plan", "remat-plan": "plan",
        "scripts/plan_acceptance.py": "estimate"}  # it composes estimate.yaml
NOT_COMPOSED = ("make ", "bash scripts/gpu_check.sh", "python -m remat.report",
                "remat-report")


def readme_commands() -> list[str]:
    """Command lines of the README's bash blocks (continuations joined, comments cut)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def _words(command: str) -> list[str]:
    """The command's words: ``<...>`` placeholders filled, ``VAR=value`` prefixes dropped."""
    words = shlex.split(re.sub(r"<[^>]+>", "placeholder", command), comments=True)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # OMP_NUM_THREADS=1 ...
        words = words[1:]
    return words


def _app_and_args(command: str) -> tuple[str, list[str]] | None:
    words = _words(command)
    if words[:3] == ["python", "-m", "torch.distributed.run"] and "-m" in words[3:]:
        words = ["python", *words[words.index("-m", 3):]]  # torchrun options dropped
    if words[:1] == ["python"]:
        words = words[2:] if words[1:2] == ["-m"] else words[1:]
    if not words or words[0] not in APPS:
        return None
    return APPS[words[0]], words[1:]


def _composable(args: list[str]) -> list[str]:
    """Overrides as ``compose`` takes them: no ``-m``, a sweep at its first value,
    placeholders filled."""
    out = []
    for arg in args:
        if arg == "-m":
            continue
        key, _, value = arg.partition("=")
        if "," in value and not value.startswith(("[", "{", "'")):
            value = value.split(",")[0]
        out.append(f"{key}={value}" if _ else arg)
    return out


COMMANDS = [c for c in readme_commands()
            if not " ".join(_words(c)).startswith(NOT_COMPOSED)]


def test_every_readme_command_is_covered():
    """A command of another kind would go unchecked: this list must grow with it."""
    assert COMMANDS, "no commands found in README.md"
    unknown = [c for c in COMMANDS if _app_and_args(c) is None]
    assert not unknown, unknown


def test_every_readme_command_composes():
    """One Hydra initialisation for all commands; every failure is listed."""
    failures = []
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(config_dir())):
        for command in COMMANDS:
            app, args = _app_and_args(command)
            try:
                cfg = compose(app, overrides=_composable(args), return_hydra_config=True)
                assert cfg.hydra.job.name is not None
            except Exception as err:  # noqa: BLE001 - collected and reported together
                failures.append(f"{command}\n    -> {type(err).__name__}: {err}")
    GlobalHydra.instance().clear()
    assert not failures, "\n".join(failures)


TINY = {
    "train": ["data.image_size=64", "data.num_train=4", "data.num_val=2", "data.batch_size=2",
              "trainer.max_steps=1", "trainer.accelerator=cpu", "callbacks=minimal",
              "trainer.enable_progress_bar=false"],
    "bench": ["data.batch_size=1", "warmup=0", "steps=1"],
    "estimate": ["data.batch_size=1"],
}


@pytest.mark.slow
@pytest.mark.parametrize("command,tiny", [
    ("python train.py strategy=sqrtn", TINY["train"]),
    ("python -m remat.bench model=gpt_small data.batch_size=2 data.block_size=1024 "
     "'strategies=[none,full,sqrtn,{name: selective, policy: matmul}]'",
     [*TINY["bench"], "data.block_size=64", "model.n_layer=2"]),
    ("python -m remat.estimate model=unet_resnet34 data.image_size=2048 data.batch_size=8 "
     "strategy=sqrtn precision=bf16-mixed", [*TINY["estimate"], "data.image_size=64"]),
])
def test_readme_command_runs_at_tiny_sizes(tmp_path, command, tiny):
    # as written in the README, its comment cut and its continuation's spaces joined
    assert command in [" ".join(re.sub(r"\s+#.*$", "", c).split()) for c in readme_commands()]
    _, args = _app_and_args(command)
    module = {"train": "remat.train", "bench": "remat.bench",
              "estimate": "remat.estimate"}[_app_and_args(command)[0]]
    proc = run_python(["-m", module, *args, *tiny, f"hydra.run.dir={tmp_path}/run",
                       f"paths.output_dir={tmp_path}/run"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
