"""A run's own configuration, for resuming and scoring it with nothing repeated.

A training run writes its resolved config (``config.yaml``) and Hydra's record of how it was
composed (``.hydra/overrides.yaml``, ``.hydra/hydra.yaml``) into its folder. Resuming with
``python train.py ckpt_path=<run>/checkpoints/last.ckpt`` (or ``ckpt_path=last
hydra.run.dir=<run>``) rebuilds that run:

* :func:`resume_args` (called on the command line before Hydra composes it) puts the run's
  own overrides (the first run's, then those of each resume that trained) in front of the
  command line's, which win key by key, and continues in the run's folder; each attempt's
  Hydra files and log go to ``<run>/resumes/<time>/`` so the run's own ``config.yaml`` and
  ``.hydra/`` are never written again;
* :func:`restore_run_config` then sets every value the command line did not change back to
  the run's ``config.yaml`` (where a newer remat composes a default differently) and lists
  the keys the command line changed.

:func:`group_choices` gives the config groups a run was composed with (``data=kvasir_seg``),
so ``remat.eval ckpt_path=... data.root=...`` composes the run's data node before its key
overrides apply.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import secrets
import warnings
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)

#: attempts to resume a run keep their own files here, inside the run folder
RESUMES = "resumes"
#: the environment variable holding the overrides typed on the command line (JSON list), set
#: by :func:`resume_args`: the overrides Hydra records then include the run's own too
USER_OVERRIDES_ENV = "REMAT_USER_OVERRIDES"
_ATTEMPT_OVERRIDES = "overrides.yaml"  # written once an attempt reaches training
_DROP_PREFIXES = ("ckpt_path", "hydra.run", "hydra.sweep", "hydra.output_subdir",
                  "hydra.job_logging")


def find_run_dir(ckpt_path: str | Path | None) -> Path | None:
    """The run folder of a checkpoint in ``<run dir>/checkpoints/`` (a file, or a sharded
    checkpoint folder), when that folder holds the run's ``config.yaml``; else None."""
    if not ckpt_path or str(ckpt_path) in ("last", "best", "hpc", "registry"):
        return None
    path = Path(str(ckpt_path)).expanduser().absolute()
    if path.parent.name != "checkpoints":
        return None
    run = path.parent.parent
    return run if (run / "config.yaml").is_file() else None


def _parse(overrides: Sequence[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(list(overrides))


def override_keys(overrides: Sequence[str]) -> list[str]:
    """The key or group each override sets (``+callbacks.kill.step=3`` -> ``callbacks.kill.
    step``, ``model=gpt_tiny`` -> ``model``), in order."""
    return [o.key_or_group for o in _parse(overrides)]


def _covered(key: str, by: Iterable[str]) -> bool:
    """``key`` is one of ``by`` or lies below one (``model.net.width`` below ``model.net``)."""
    return any(key == k or key.startswith(k + ".") for k in by)


def _value(args: Sequence[str], key: str) -> str | None:
    """The last value the command line gives ``key`` (quotes stripped), or None."""
    found = None
    for arg in args:
        name, sep, value = arg.partition("=")
        if sep and name.lstrip("+~") == key:
            found = value.strip().strip("'\"")
    return found


def run_overrides(run_dir: Path) -> list[str]:
    """The overrides that made the run in ``run_dir``: the first run's (Hydra's
    ``.hydra/overrides.yaml``), then each resume that reached training
    (``resumes/<time>/overrides.yaml``), later ones winning key by key; its checkpoint and
    folder settings (``ckpt_path``, ``hydra.run.*``, log file) left out."""
    chain: list[str] = []
    first = run_dir / ".hydra" / "overrides.yaml"
    files = [first] if first.is_file() else []
    attempts = run_dir / RESUMES
    if attempts.is_dir():
        files += sorted(p / _ATTEMPT_OVERRIDES for p in attempts.iterdir()
                        if (p / _ATTEMPT_OVERRIDES).is_file())
    for file in files:
        given = [str(o) for o in (OmegaConf.to_container(OmegaConf.load(file)) or [])]
        given = [o for o, k in zip(given, override_keys(given), strict=True)
                 if not _covered(k, _DROP_PREFIXES)]
        keys = override_keys(given)
        chain = [o for o, k in zip(chain, override_keys(chain), strict=True)
                 if not _covered(k, keys)] + given
    return chain


def _quoted(value: str) -> str:
    """A path as a Hydra override value (quoted where the grammar would split it)."""
    return value if value.replace("/", "").replace("-", "").replace("_", "").replace(
        ".", "").isalnum() else "'" + value.replace("'", "\\'") + "'"


def resume_args(args: Sequence[str], task_name: str = "train") -> list[str]:
    """The command line of a resume, completed from the run it resumes.

    When ``args`` resume a run (``ckpt_path=<run>/checkpoints/<file>``, or ``ckpt_path=last``
    with ``hydra.run.dir=<run>``) whose folder holds its Hydra record, the run's own
    overrides (:func:`run_overrides`) go first, minus every key ``args`` set (or delete)
    again; the run continues in its folder (``hydra.run.dir``, unless given), and Hydra's
    files and the log of this attempt go to ``<run>/resumes/<time>/``. The typed overrides
    are kept in ``$REMAT_USER_OVERRIDES`` for :func:`user_overrides`. Anything else (no
    checkpoint, a multirun, a checkpoint outside a run folder, a command line completed
    already) is returned as it is.
    """
    args = list(args)
    if any(a in ("-m", "--multirun") or a.startswith("hydra.output_subdir=") for a in args):
        return args
    ckpt = _value(args, "ckpt_path")
    given_dir = _value(args, "hydra.run.dir")
    run_dir = find_run_dir(ckpt) if ckpt and ckpt != "last" else (
        Path(given_dir).expanduser().absolute() if ckpt == "last" and given_dir else None)
    if run_dir is None or not (run_dir / ".hydra" / "overrides.yaml").is_file():
        return args
    flags = [a for a in args if a.startswith("-")]
    typed = [a for a in args if not a.startswith("-")]
    keys = override_keys(typed)
    inherited = run_overrides(run_dir)
    inherited_keys = override_keys(inherited)
    # a typed delete of a node that only the run's overrides added (+callbacks.kill...):
    # both go, since without the addition there is nothing to delete
    added = [k for o, k in zip(_parse(inherited), inherited_keys, strict=True)
             if o.type.name in ("ADD", "FORCE_ADD")]
    dropped = {k for a, k in zip(typed, keys, strict=True)
               if a.startswith("~") and any(_covered(x, [k]) for x in added)}
    typed = [a for a, k in zip(typed, keys, strict=True) if k not in dropped]
    keys = override_keys(typed) + sorted(dropped)
    kept = [o for o, k in zip(inherited, inherited_keys, strict=True) if not _covered(k, keys)]
    out_dir = Path(given_dir).expanduser().absolute() if given_dir else run_dir
    extra = [] if given_dir else [f"hydra.run.dir={_quoted(str(run_dir))}"]
    if out_dir.resolve() == run_dir.resolve():
        stamp = f"{datetime.now():%Y-%m-%d_%H-%M-%S}_{secrets.token_hex(2)}"
        attempt = f"{RESUMES}/{stamp}"
        # the log file opens at its first line (delay), after Hydra made the attempt folder
        extra += [f"hydra.output_subdir={attempt}/.hydra",
                  "hydra.job_logging.handlers.file.filename="
                  + _quoted(str(run_dir / attempt / f"{task_name}.log")),
                  "++hydra.job_logging.handlers.file.delay=true"]
    os.environ[USER_OVERRIDES_ENV] = json.dumps(typed)
    log.debug("resuming %s: its overrides %s, then %s", run_dir, kept, typed)
    return [*flags, *kept, *typed, *extra]


def user_overrides(hydra_overrides: Sequence[str]) -> list[str]:
    """The overrides typed on the command line: those :func:`resume_args` recorded, else
    all of Hydra's (nothing was added to them)."""
    recorded = os.environ.get(USER_OVERRIDES_ENV)
    if recorded is not None:
        try:
            typed = [str(o) for o in json.loads(recorded)]
        except ValueError:
            typed = None
        if typed is not None and set(typed) <= set(hydra_overrides):
            return typed  # (a record of another command line is not this one's)
    return list(hydra_overrides)


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: value}`` of a nested mapping (lists and empty mappings are values)."""
    if isinstance(node, Mapping) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_leaves(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): node}


def _under(value: Any, folder: str | None) -> bool:
    return bool(folder) and isinstance(value, str) and value.startswith(str(folder))


def restore_run_config(cfg: DictConfig, run_config: Path, typed: Sequence[str]
                       ) -> tuple[list[str], list[str]]:
    """Set back every value of ``cfg`` that differs from the run's ``config.yaml`` and that
    no ``typed`` override set (a default that a newer remat composes differently), in place.

    Values that name the output folder (``paths.output_dir``, checkpoint folders, logger
    folders) follow this run's folder, not the earlier one; ``ckpt_path`` is this run's;
    values composed from another key (``${data.image_size}``) follow that key.

    Returns:
        ``(restored, changed)``: ``"key: now -> run's"`` for each value set back, and
        ``"key: run's -> now"`` for each value the typed overrides changed.
    """
    run = OmegaConf.to_container(OmegaConf.load(run_config), resolve=False)
    ours = OmegaConf.to_container(cfg, resolve=True)
    raw = OmegaConf.to_container(cfg, resolve=False)
    for node in (run, ours, raw):
        node.pop("hydra", None)
    theirs_flat, ours_flat = _leaves(run), _leaves(ours)
    # a value composed from another (${data.image_size}) follows that one: not set back
    derived = {k for k, v in _leaves(raw).items() if isinstance(v, str) and "${" in v}
    keys = override_keys(typed)
    old_dir = (run.get("paths") or {}).get("output_dir")
    new_dir = (ours.get("paths") or {}).get("output_dir")
    restored, changed = [], []
    for key, then in theirs_flat.items():
        if key not in ours_flat or key == "ckpt_path" or key.startswith("paths.") \
                or key in derived:
            continue
        now = ours_flat[key]
        if now == then or _under(then, old_dir) or _under(now, new_dir):
            continue
        if _covered(key, keys):
            changed.append(f"{key}: {then!r} -> {now!r}")
            continue
        restored.append(f"{key}: {now!r} -> {then!r}")
        with open_dict(cfg):
            OmegaConf.update(cfg, key, then, force_add=True)
    for key in ours_flat.keys() - theirs_flat.keys():
        if _covered(key, keys) and not key.startswith("paths.") and key != "ckpt_path":
            changed.append(f"{key}: (unset) -> {ours_flat[key]!r}")
    return restored, sorted(changed)


def attempt_dir(run_dir: Path, hydra_subdir: str | None = None) -> Path:
    """The folder of this attempt to resume the run in ``run_dir``: the one
    :func:`resume_args` gave Hydra (``resumes/<time>/``), or a new one."""
    if hydra_subdir and str(hydra_subdir).startswith(f"{RESUMES}/"):
        folder = run_dir / Path(str(hydra_subdir)).parent
    else:
        folder = run_dir / RESUMES / f"{datetime.now():%Y-%m-%d_%H-%M-%S}_{secrets.token_hex(2)}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def record_trained_attempt(folder: Path, typed: Sequence[str]) -> None:
    """Note that the attempt in ``folder`` reached training: its typed overrides then count
    for later resumes (:func:`run_overrides`)."""
    OmegaConf.save(OmegaConf.create(list(typed)), folder / _ATTEMPT_OVERRIDES)


def group_choices(run_dir: Path) -> dict[str, str]:
    """``{group: option}`` the run in ``run_dir`` was composed with: Hydra's record
    (``.hydra/hydra.yaml`` ``runtime.choices``; ``hydra/...`` groups left out), or, for a
    run made by calling ``train(cfg)`` without that record, the first ``data`` and
    ``model`` options of the config tree that build the run's ``_target_``; ``{}`` when
    neither is found."""
    file = run_dir / ".hydra" / "hydra.yaml"
    if file.is_file():
        choices = OmegaConf.select(OmegaConf.load(file), "hydra.runtime.choices") or {}
        return {str(k): str(v) for k, v in choices.items()
                if v is not None and not str(k).startswith("hydra")}
    config = run_dir / "config.yaml"
    if not config.is_file():
        return {}
    from remat.config import config_dir

    run = OmegaConf.load(config)
    found: dict[str, str] = {}
    for group in ("data", "model"):
        target = OmegaConf.select(run, f"{group}._target_")
        for option in sorted((config_dir() / group).glob("*.yaml")):
            if target and OmegaConf.load(option).get("_target_") == target:
                found[group] = option.stem
                break
    return found


def find_run_config(ckpt_path: str | Path) -> Path | None:
    """``<run dir>/config.yaml`` for a checkpoint in ``<run dir>/checkpoints/``, if present."""
    run = find_run_dir(ckpt_path)
    return run / "config.yaml" if run is not None else None


def run_group_args(args: list[str]) -> list[str]:
    """The command line with the run's own ``data`` and ``model`` choices in front (those
    the command line does not choose), so that key overrides of the run's data and model
    (``data.root=...``, ``data.split_file=...``) compose without ``+``. A choice equal to
    the run's own is not a replacement (:func:`apply_run_config`)."""
    run = find_run_dir(next((a.partition("=")[2].strip("'\"") for a in reversed(args)
                             if a.startswith("ckpt_path=")), None))
    if run is None or any(a.startswith("run_config=") for a in args):
        return list(args)
    given = set(override_keys([a for a in args if not a.startswith("-")]))
    choices = group_choices(run)
    extra = [f"{group}={choices[group]}" for group in ("data", "model")
             if group in choices and group not in given]
    _check_group_keys(run, choices, given, set(override_keys(
        [a for a in args if not a.startswith(("-", "+", "~"))])))
    return [*extra, *args]


def _check_group_keys(run: Path, choices: dict[str, str], given: set[str],
                      plain: set[str]) -> None:
    """Refuse a ``data.<key>=`` / ``model.<key>=`` override (``plain``: those without ``+``)
    of a key neither the run's own data or model config nor the current one of that choice
    has, when the command line keeps the run's choice (Hydra's "Key 'root' is not in
    struct" otherwise): a run trained on ``data=synthetic_seg`` has no ``data.root``, so
    another folder needs ``data=folder`` beside it.

    Raises:
        ValueError: names the key, the run's choice and what to add.
    """
    config = run / "config.yaml"
    if not config.is_file():
        return
    saved = OmegaConf.load(config)
    for group in ("data", "model"):
        node = saved.get(group)
        if group in given or group not in choices or not isinstance(node, DictConfig):
            continue
        missing = [key for key in sorted(plain) if key.partition(".")[0] == group
                   and key.split(".")[1] not in node]
        if not missing:
            continue
        from hydra import compose, initialize_config_dir

        from remat.config import config_dir

        with initialize_config_dir(version_base="1.3", config_dir=str(config_dir())):
            current = compose("train", overrides=[f"{group}={choices[group]}"])[group]
        for key in missing:
            leaf = key.split(".")[1]
            if leaf in current:
                continue
            hint = (f"to read another folder give its dataset too, e.g. data=folder "
                    f"{key}=<folder>" if key == "data.root"
                    else f"give {group}=<name> to choose another config")
            raise ValueError(f"{key}: the run was trained with {group}={choices[group]}, "
                             f"which has no {leaf!r} key; {hint}")


def run_config_path(cfg: DictConfig) -> Path | None:
    """The run config to start from: ``run_config`` (``auto``: beside ``checkpoints/``; a
    path; or null: none)."""
    setting = cfg.get("run_config", "auto")
    if setting is None or setting is False:
        return None
    if str(setting) == "auto":
        return find_run_config(cfg.ckpt_path)
    path = Path(str(setting)).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"run_config={setting}: no such file (expected the config.yaml "
                                "a training run writes; auto finds it beside checkpoints/)")
    return path


def _command_line() -> tuple[list[Any], dict[str, Any]]:
    """The parsed command-line overrides and the config groups' choices (``{group: option}``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # evaluate() called without Hydra
        return [], {}
    overrides = OverridesParser.create().parse_overrides(list(hydra_cfg.overrides.task))
    return overrides, dict(hydra_cfg.runtime.choices)


def _delete(cfg: DictConfig, key: str) -> None:
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if isinstance(parent, DictConfig) and leaf in parent:
        del parent[leaf]


def apply_run_config(cfg: DictConfig, run: DictConfig | None, run_path: Path | None,
                     keys: Sequence[str]) -> DictConfig:
    """The config to score or predict with: ``cfg`` (the entry's config composed with the
    command line) with the top-level ``keys`` of the run's config ``run`` (its
    ``config.yaml``, read from ``run_path``), and the command line's key overrides of those
    keys applied again on top; ``cfg`` itself when ``run`` is None.

    Group overrides ``data=<name>`` / ``model=<name>`` keep the composed node instead of the
    run's. ``experiment=<name>`` does not replace the run's config (it is what the run was
    composed from); a different ``task_name`` than the run's warns.
    """
    if run is None:
        return cfg
    overrides, groups = _command_line()
    run_choices = group_choices(run_path.parent) if run_path is not None else {}
    # a group chosen as the run chose it is the run's node (with key overrides on top)
    chosen = {o.key_or_group for o in overrides if o.key_or_group in groups
              and groups[o.key_or_group] != run_choices.get(o.key_or_group)}
    merged = copy.deepcopy(cfg)
    with open_dict(merged):
        for key in keys:
            if key not in chosen and key in run:
                merged[key] = run[key]
        for override in overrides:
            key = override.key_or_group
            top = key.split(".")[0]
            if key in groups or top not in keys or top in chosen:
                continue  # a group, or a key the composed config already holds as given
            if override.is_delete():
                _delete(merged, key)
            else:
                OmegaConf.update(merged, key, OmegaConf.select(cfg, key), force_add=True)
    if "experiment" in chosen and cfg.get("task_name") != run.get("task_name"):
        warnings.warn(
            f"experiment={groups['experiment']} (task {cfg.get('task_name')}) is not what the "
            f"checkpoint's run trained (task {run.get('task_name')}, {run_path}); scoring with "
            "the run's config. Pass run_config=null to score with the experiment instead",
            UserWarning, stacklevel=2)
    return merged
