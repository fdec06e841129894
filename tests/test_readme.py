"""Every command in the README and the docs composes as written; the README's own-data recipe
and one command of each entry point run at tiny sizes.

The default run checks each ``python train.py``, ``python -m remat.<app>`` and ``remat-*``
command of the bash blocks of ``README.md`` and of every page under ``docs/`` (the benchmark
result files' commands included) against the real config tree (Hydra's own compose: an
unknown key, option or group fails), with ``<...>`` placeholders filled in and a multirun's
sweep lists taken at their first value. ``make`` targets and ``pip`` are what CI itself runs;
``scripts/gpu_check.sh`` has its own slow test; ``remat.report`` reads a sweep folder
(``tests/test_report.py``). The README's own-data recipe (train on a folder, resume, evaluate
on another folder, predict) runs for real on a tiny folder the test writes, and one command of
each entry point runs with tiny sizes appended (both slow: ``make test-all``).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from remat.config import config_dir
from tests.data.test_folder import write_folder
from tests.helpers import run_python

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
APPS = {"train.py": "train", "remat.train": "train", "remat-train": "train",
        "remat.bench": "bench", "remat-bench": "bench", "remat.estimate": "estimate",
        "remat-estimate": "estimate", "remat.eval": "eval", "remat-eval": "eval",
        "remat.plan": "plan", "remat-plan": "plan", "remat.predict": "predict",
        "remat-predict": "predict",
        # these scripts compose estimate.yaml from their overrides (their --flags aside)
        "scripts/plan_acceptance.py": "estimate", "scripts/estimate_vs_allocator.py": "estimate",
        "scripts/budget_fraction_check.py": "estimate"}
# scripts/compile_verdict.py reads bench.json files (tests/test_compile_verdict.py)
NOT_COMPOSED = ("make ", "pip ", "bash scripts/gpu_check.sh", "python -m remat.report",
                "remat-report", "python scripts/render_docs_tables.py",
                "python scripts/compile_verdict.py")


def doc_pages() -> list[Path]:
    """README.md and every Markdown file under docs/ (result companions included)."""
    return [README, *sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)]


def bash_commands(path: Path) -> list[str]:
    """Command lines of a Markdown file's bash blocks (continuations joined, comments cut)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def readme_commands() -> list[str]:
    """Command lines of the README's bash blocks."""
    return bash_commands(README)


def doc_commands() -> list[str]:
    """Command lines of the README's and every docs page's bash blocks, each once."""
    return list(dict.fromkeys(c for page in doc_pages() for c in bash_commands(page)))


def _one_line(command: str) -> str:
    """A command as written, its comment cut and its continuation's spaces joined."""
    return " ".join(re.sub(r"\s+#.*$", "", command).split())


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
    flag_value = False
    for arg in args:
        if flag_value and "=" not in arg and not arg.startswith("--"):
            flag_value = False
            continue  # a script flag's value (--fraction 0.6)
        flag_value = arg.startswith("--")
        if arg == "-m" or flag_value:
            continue
        key, _, value = arg.partition("=")
        if "," in value and not value.startswith(("[", "{", "'")):
            value = value.split(",")[0]
        out.append(f"{key}={value}" if _ else arg)
    return out


def _run_groups(app: str, args: list[str]) -> list[str]:
    """The config groups ``remat.eval``/``remat.predict`` compose from the run a ``<run>``
    checkpoint stands for (:func:`remat.run_config.run_group_args` reads them from the run's
    folder): a ``data.root=`` override means a run on files, ``data=folder``."""
    if app not in ("eval", "predict") or any(a.startswith("data=") for a in args):
        return []
    return ["data=folder"] if any(a.startswith("data.root=") for a in args) else []


COMMANDS = [c for c in doc_commands() if not " ".join(_words(c)).startswith(NOT_COMPOSED)]


def test_every_documented_command_is_covered():
    """A command of another kind would go unchecked: this list must grow with it."""
    assert [c for c in COMMANDS if c in readme_commands()], "no commands found in README.md"
    assert len(COMMANDS) > len(readme_commands()), "no commands found in docs/"
    unknown = [c for c in COMMANDS if _app_and_args(c) is None]
    assert not unknown, unknown


def test_every_documented_command_composes():
    """One Hydra initialisation for all commands of the README and the docs; every failure
    is listed."""
    failures = []
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(config_dir())):
        for command in COMMANDS:
            app, args = _app_and_args(command)
            try:
                overrides = [*_run_groups(app, args), *_composable(args)]
                cfg = compose(app, overrides=overrides, return_hydra_config=True)
                assert cfg.hydra.job.name is not None
            except Exception as err:  # noqa: BLE001 - collected and reported together
                failures.append(f"{command}\n    -> {type(err).__name__}: {err}")
    GlobalHydra.instance().clear()
    assert not failures, "\n".join(failures)


def test_the_readme_is_a_short_user_page():
    """At most 200 lines, with the test command CI greps for, and no history: no dated run
    folders, issue numbers or machine load (those belong nowhere in user docs)."""
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert any(c.split("#")[0].split() == ["make", "test"] for c in readme_commands())
    for page in doc_pages():
        body = page.read_text()
        for pattern in (r"\b20\d\d-\d\d-\d\d\b", r"\bissue \d+", r"load average",
                        r"\bload \d"):
            found = re.findall(pattern, body, re.I)
            assert not found, f"{page.relative_to(ROOT)}: {found}"


def test_every_relative_link_of_the_readme_and_docs_resolves():
    """The README is read on GitHub (not built by Sphinx): its links to docs/ must exist."""
    broken = []
    for page in doc_pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def _readme_line(start: str) -> str:
    """The README command that starts with ``start`` (so the test runs what users read)."""
    found = [_one_line(c) for c in readme_commands() if _one_line(c).startswith(start)]
    assert found, f"no README command starts with {start!r}"
    return found[0]


def _args(command: str, fill: dict[str, str]) -> list[str]:
    """The command's arguments after its app, ``<...>`` placeholders replaced from ``fill``."""
    for placeholder, value in fill.items():
        command = command.replace(placeholder, value)
    assert "<" not in command, command
    words = shlex.split(command)
    return words[2:] if words[:2] == ["python", "train.py"] else words[3:]


def _layout(root: Path, line: str) -> int:
    """Write the tiny folder a README ``data=folder`` line reads; returns its pair count."""
    n = 4
    if "mask_encoding=palette" in line:
        write_folder(root, n=n, encoding="palette", classes=3)
    elif "data.threshold=128" in line:
        write_folder(root, n=n, encoding="255", mask_suffix=".jpg")  # JPEG noise in the masks
    elif "data.images=images/*.tif" in line:
        write_folder(root, n=n, encoding="255", image_suffix=".tif")
        (root / "labels").mkdir()
        for mask in sorted((root / "masks").iterdir()):
            mask.rename(root / "labels" / f"{mask.stem}_mask.png")
        (root / "masks").rmdir()
    elif "data.pairs=" in line:
        write_folder(root / "files", n=n, encoding="255")
        rows = [f"files/images/case{i}.png,files/masks/case{i}.png" for i in range(n)]
        (root / "pairs.csv").write_text("image,mask\n" + "\n".join(rows) + "\n")
    else:
        write_folder(root, n=n, encoding="255")
    return n


def test_the_readme_data_folder_lines_find_their_pairs(tmp_path, monkeypatch):
    """Each ``data=folder`` line of the README, on the layout it describes (relative roots
    from the working folder, as a user types them): every pair found, the data check passed,
    the classes as the line says."""
    from hydra.utils import instantiate

    from tests.helpers import compose_train

    lines = [_one_line(c) for c in readme_commands()
             if _one_line(c).startswith("python train.py data=folder")]
    assert len(lines) >= 5, lines
    for number, line in enumerate(lines):
        folder = tmp_path / str(number)
        args = _args(line, {})
        root = folder / next(a.split("=", 1)[1] for a in args if a.startswith("data.root="))
        pairs = _layout(root, line)
        monkeypatch.chdir(folder)
        cfg = compose_train(folder / "run", [*args, "data.patch_size=16"])
        dm = instantiate(cfg.data)
        dm.setup("fit")
        assert len(dm.pairs) == pairs, line
        assert dm.num_classes == (3 if "num_classes=3" in line else 1), line
        assert cfg.model.num_classes == dm.num_classes, line


FOLDER_TINY = ["data.patch_size=32", "data.batch_size=2", "trainer.max_epochs=1",
               "trainer.accelerator=cpu", "callbacks=minimal", "trainer.enable_progress_bar=false",
               "trainer.enable_model_summary=false"]


@pytest.mark.slow  # four entry-point processes: about 1.5 min on 2 shared cores
def test_the_readme_own_data_recipe_runs(tmp_path):
    """Train on a folder (images/ + masks/ of matched stems), resume with ckpt_path alone,
    evaluate on another folder with split=all and predict masks: the README's own commands,
    in subprocesses, with tiny sizes appended. (``tests/test_predict.py`` runs the same
    path in-process in the fast suite.)"""
    write_folder(tmp_path / "my_data", n=6, size=(40, 48), encoding="255")
    write_folder(tmp_path / "other", n=2, size=(36, 44), encoding="255", seed=20)
    run = tmp_path / "run"

    train = _args(_readme_line("python train.py data=folder data.root=my_data"), {})
    assert train == ["data=folder", "data.root=my_data"]
    proc = run_python(["-m", "remat.train", *train, *FOLDER_TINY, f"hydra.run.dir={run}"],
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads((run / "summary.json").read_text())
    assert first["status"] == "completed" and first["global_step"] > 0

    resume = _args(_readme_line("python train.py ckpt_path="), {"<run>": str(run)})
    assert resume == [f"ckpt_path={run}/checkpoints/last.ckpt"]
    proc = run_python(["-m", "remat.train", *resume, "trainer.max_epochs=2"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = json.loads((run / "summary.json").read_text())  # the same folder, trained on
    assert second["status"] == "completed"
    assert second["global_step"] == 2 * first["global_step"]
    assert not (tmp_path / "outputs").exists()  # no new run folder

    evaluate = _args(_readme_line("python -m remat.eval ckpt_path=<run>/checkpoints/last.ckpt "
                                  "data.root="),
                     {"<run>": str(run), "<other folder>": str(tmp_path / "other")})
    proc = run_python(["-m", "remat.eval", *evaluate, f"hydra.run.dir={tmp_path / 'eval'}"],
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["num_images"] == 2 and metrics["split"] == "all"

    predict = _args(_readme_line("python -m remat.predict"),
                    {"<run>": str(run), "<folder>": str(tmp_path / "other" / "images"),
                     "<masks folder>": str(tmp_path / "masks")})
    proc = run_python(["-m", "remat.predict", *predict, f"hydra.run.dir={tmp_path / 'p'}"],
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from PIL import Image

    for image in (tmp_path / "other" / "images").iterdir():
        mask = Image.open(tmp_path / "masks" / f"{image.stem}.png")
        assert mask.size == Image.open(image).size and mask.mode == "L"
    assert (tmp_path / "masks" / "predictions.csv").is_file()


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
def test_documented_command_runs_at_tiny_sizes(tmp_path, command, tiny):
    # as written in the README or the docs, its comment cut and its continuation's spaces joined
    assert command in [_one_line(c) for c in doc_commands()]
    _, args = _app_and_args(command)
    module = {"train": "remat.train", "bench": "remat.bench",
              "estimate": "remat.estimate"}[_app_and_args(command)[0]]
    proc = run_python(["-m", module, *args, *tiny, f"hydra.run.dir={tmp_path}/run",
                       f"paths.output_dir={tmp_path}/run"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
