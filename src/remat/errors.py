"""How the entry points end on a user's mistake: one line, not a traceback.

A bad config value, a missing or malformed file, a model that does not fit the data: the
library raises an error whose message names the key or file and the fix. An entry point
run from the command line prints that message as ``error: <message>`` and exits with 1,
before Lightning starts and without a traceback (``HYDRA_FULL_ERROR=1`` shows it). Errors
raised while Lightning trains or evaluates (marked by :func:`mark_in_loop`) and errors of
remat's own code (``AttributeError``, ``AssertionError``, ...) keep their traceback.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

T = TypeVar("T")

#: the kinds of error whose message is the whole story for a user
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, KeyError, ImportError,
    OmegaConfBaseException)
_IN_LOOP = "_remat_in_loop"
_SETUP = "_remat_setup_error"


def setup_error(err: BaseException) -> BaseException:
    """Mark ``err``, raised inside a loop, as a mistake in the run's settings found there
    (stages the training forward never calls, seen after the first step): the entry
    point prints it as one line, as it does for errors found before Lightning starts."""
    setattr(err, _SETUP, True)
    return err


@contextmanager
def mark_in_loop() -> Iterator[None]:
    """Errors raised inside (Lightning's fit/validate/test/predict loops) keep their
    traceback: they happened while the run was running, not while it was set up."""
    try:
        yield
    except BaseException as err:
        try:
            setattr(err, _IN_LOOP, True)
        except AttributeError:  # pragma: no cover - exceptions without a __dict__
            pass
        raise


_LOCATING = re.compile(r"Error locating target '([^']+)'")
_FULL_KEY = re.compile(r"full_key: (\S+)")


def unimportable_target(err: BaseException) -> ImportError | None:
    """The message a user needs for Hydra's ``Error locating target '<t>'`` (an
    ``InstantiationException`` that names neither the key's ``_target_`` nor the fix, e.g.
    ``model.net._target_=mypkg.MyNet`` whose folder is not on ``PYTHONPATH``), or None
    for any other error. The returned error is raised from ``err`` (chained).

    Returns:
        ImportError naming ``<full_key>._target_=<t>`` and which of three it is: the module
        is not importable (put the folder holding it on PYTHONPATH, or install it), the
        module imports but needs a package that is missing, or the module lacks the name.
    """
    from hydra.errors import InstantiationException

    found = _LOCATING.search(str(err)) if isinstance(err, InstantiationException) else None
    if found is None:
        return None
    target = found.group(1)
    key = _FULL_KEY.search(str(err))
    setting = f"{key.group(1)}._target_={target}" if key else f"_target_={target}"
    missing, cause, seen = None, err.__cause__, set()
    while cause is not None and id(cause) not in seen and missing is None:
        seen.add(id(cause))
        if isinstance(cause, ModuleNotFoundError) and cause.name:
            missing = cause.name
        cause = cause.__cause__ or cause.__context__
    module, _, name = target.rpartition(".")
    if missing is None or missing == target:
        why = (f"module {module!r} has no attribute {name!r}; check the spelling of the "
               "class or function" if module else "give the full dotted path, e.g. "
               "mypkg.nets.MyNet")
    elif target.startswith(missing + "."):
        top = missing.split(".", 1)[0]
        why = (f"module {missing!r} is not importable: the folder holding {top}/ (or "
               f"{top}.py) must be on PYTHONPATH (PYTHONPATH=/path/to/that/folder python "
               f"train.py ...), or install its project (pip install -e <project>)")
    else:
        why = (f"module {module!r} imports {missing!r}, which is not installed "
               f"(pip install {missing.split('.', 1)[0]})")
    new = ImportError(f"{setting} cannot be imported: {why}")
    new.__cause__ = err
    return new


def _closest(name: str, names: list[str], n: int = 3, cutoff: float = 0.5) -> list[str]:
    """Up to ``n`` of ``names`` closest to ``name`` (difflib, ``cutoff``), the size key of
    the other kind of dataset first: ``image_size`` (synthetic data, whole images) for
    ``patch_size`` (file datasets, random crops) and back."""
    import difflib

    near = difflib.get_close_matches(name, names, n=n, cutoff=cutoff)
    twin = {"image_size": "patch_size", "patch_size": "image_size"}.get(name)
    return [twin, *[k for k in near if k != twin]][:n] if twin in names else near


_UNEXPECTED = re.compile(r"got an unexpected keyword argument '([^']+)'")
_TARGET = re.compile(r"Error in call to target '([^']+)'")


def unexpected_argument(err: BaseException) -> ValueError | None:
    """One line for Hydra's three-line ``Error in call to target '<t>': TypeError(... got an
    unexpected keyword argument 'k') full_key: <key>``: ``<key>.k`` named as the setting,
    with the target's arguments closest to ``k`` (``data=folder data.image_size=64``:
    did you mean data.patch_size?), or all of them; None for any other error."""
    import inspect

    from hydra.errors import InstantiationException

    if not isinstance(err, InstantiationException) or not isinstance(err.__cause__, TypeError):
        return None
    arg, target = _UNEXPECTED.search(str(err)), _TARGET.search(str(err))
    key = _FULL_KEY.search(str(err))
    if target is not None and arg is None and "takes no arguments" in str(err):
        # a class without an __init__ of its own (strategy=sqrtn +strategy.k=2)
        node = key.group(1) if key else "its config"
        new = ValueError(f"{node}: {target.group(1)} takes no arguments; remove the "
                         f"{node}.<name> settings given")
        new.__cause__ = err
        return new
    if arg is None or target is None:
        return None
    setting = f"{key.group(1)}.{arg.group(1)}" if key else arg.group(1)
    params: list[str] = []
    try:
        from hydra.utils import get_object

        obj = get_object(target.group(1))
        # a class passing **kwargs on takes its bases' arguments too
        for fn in ([c.__init__ for c in obj.__mro__ if "__init__" in vars(c)]
                   if isinstance(obj, type) else [obj]):
            sig = inspect.signature(fn).parameters.values()
            params += [p.name for p in sig if p.name not in params and p.name != "self"
                       and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            if not any(p.kind == p.VAR_KEYWORD for p in sig):
                break
    except (ImportError, TypeError, ValueError):
        pass
    prefix = f"{key.group(1)}." if key else ""
    near = _closest(arg.group(1), params)
    hint = (f"did you mean {', '.join(prefix + n for n in near)}?" if near
            else f"it takes {', '.join(params)}" if params else "")
    new = ValueError(f"{setting}: {target.group(1)} takes no argument {arg.group(1)!r}"
                     + (f"; {hint}" if hint else ""))
    new.__cause__ = err
    return new


def user_error(err: BaseException) -> BaseException | None:
    """The error to show a user for ``err`` raised while setting a run up: ``err`` itself,
    or, for Hydra's ``InstantiationException``, the error it wraps when that is a user
    error (its message names the key), :func:`unimportable_target`'s for a target that
    cannot be imported, or Hydra's own message for a wrong call (it names the ``_target_``
    and the config key); None for errors that keep their
    traceback (remat's or a user's code failing inside a constructor)."""
    if getattr(err, _SETUP, False):
        return err
    if getattr(err, _IN_LOOP, False):
        return None
    from hydra.errors import InstantiationException

    if isinstance(err, InstantiationException):
        cause = err.__cause__
        if cause is None or isinstance(cause, TypeError | ImportError):
            # Hydra's message names the _target_, the call and the config key
            return unimportable_target(err) or unexpected_argument(err) or err
        return user_error(cause)
    if isinstance(err, USER_ERRORS):
        return err
    from remat.callbacks.run_dir import RunDirInUse

    return err if isinstance(err, RunDirInUse) else None


#: what a mandatory (``???``) key of a shipped config wants, for the one-line error
MISSING_HINTS = {
    "model.net._target_": "the class (or function) that builds your network, e.g. "
                          "model.net._target_=my_pkg.nets.MyUNet; its arguments go under "
                          "+model.net.<name>=<value>",
}


def message_of(err: BaseException) -> str:
    """The text of ``err`` (a ``KeyError``'s message without the quotes ``repr`` adds; a
    mandatory config value left unset: the key and what to give it)."""
    if isinstance(err, MissingMandatoryValue) and getattr(err, "full_key", None):
        key = err.full_key
        return (f"{key} must be set: "
                + MISSING_HINTS.get(key, f"give it on the command line ({key}=<value>)"))
    if isinstance(err, KeyError) and len(err.args) == 1 and isinstance(err.args[0], str):
        return err.args[0]
    return str(err) or type(err).__name__


def run_entry(fn: Callable[[Any], T], cfg: Any, single_run: bool = True) -> T:
    """Call ``fn(cfg)`` (an entry point's work); a user error raised while setting up ends
    the process with ``error: <message>`` on stderr and exit code 1 (see the module
    docstring). ``single_run=False`` (a job of a multirun) lets every error propagate, so
    Hydra records that job's failure and the sweep goes on.

    Raises:
        SystemExit: code 1 after printing a user error's message.
    """
    try:
        return fn(cfg)
    except Exception as err:
        shown = user_error(err)
        if shown is None or not single_run or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {message_of(shown)}", file=sys.stderr)
        raise SystemExit(1) from None


def unknown_key(config_name: str, args: list[str]) -> str | None:
    """One line for the keys of a command line the composed config does not have (Hydra's
    four lines, "Could not override ... Key 'image_size' is not in struct", for the first
    one only): each key with the group's config and the closest keys it has
    (``data=folder data.image_size=64``: did you mean data.patch_size?), a node the config
    lacks altogether (``trainer.precision`` on ``remat.estimate``: did you mean
    precision?), and keys added with ``+`` that misspell one the config has
    (``+precison=bf16-mixed``, ``+data.image_sise=32``: nothing would read them). None
    when every key is known, or the command line fails otherwise (Hydra reports that), or
    holds options this check leaves to Hydra. In a multirun (``-m``) a swept key is
    checked at its first value (a ``glob``/``interval`` sweep is left to Hydra).

    Args:
        config_name: the primary config (``train``, ``plan``, ``estimate``).
        args: the command line's overrides.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException

    from remat.config import config_dir

    args = [a for a in args if a not in ("-m", "--multirun")]
    if any(a.startswith("-") for a in args):  # --cfg, -cn, --config-dir ...: Hydra's own
        return None
    overrides = [a for a in args if not a.lstrip("+~").startswith("hydra.")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 - a malformed override: Hydra says what is wrong
        return None
    # a swept key is checked at its first value (data.imge_size=32,64 names image_size);
    # a sweep that does not enumerate (glob, interval) is left to Hydra
    overrides = [o if not p.is_sweep_override() else _first_of_sweep(p)
                 for o, p in zip(overrides, parsed, strict=True)]
    overrides = [o for o in overrides if o is not None]

    def composed(given: list[str]) -> Any:
        with initialize_config_dir(version_base="1.3", config_dir=str(config_dir())):
            return compose(config_name, overrides=given, return_hydra_config=True)

    unknown: list[str] = []  # keys of overrides the config refused, in order
    for _ in range(len(overrides) + 1):
        given = [o for o in overrides if o.split("=", 1)[0] not in unknown]
        try:
            cfg = composed(given)
            break
        except ConfigCompositionException as err:
            found = _FULL_KEY.search(str(err.__cause__))
            if found is None or "is not in struct" not in str(err.__cause__):
                return None
            node = found.group(1)  # the key, or the first node of it the config lacks
            key = next((o.split("=", 1)[0] for o in given
                        if o.split("=", 1)[0] in (node,) or o.startswith(node + ".")), None)
            if key is None:
                return None
            unknown.append(key)
        except Exception:  # noqa: BLE001 - anything else is Hydra's to report
            return None
    else:
        return None
    lines = [_missing_key(cfg, key, config_name) for key in unknown]
    lines += _added_like_a_key(cfg, given)
    return "; ".join(lines) if lines else None


def _first_of_sweep(override: Any) -> str | None:
    """``key=<first value>`` of a parsed sweep override (``+x=1,2`` -> ``+x=1``), or
    ``None`` where Hydra cannot list its values here (``glob``, ``interval``)."""
    try:
        first = next(iter(override.sweep_string_iterator()))
    except Exception:  # noqa: BLE001 - Hydra's own sweep types it enumerates only itself
        return None
    return f"{override.get_key_element()}={first}"


def _missing_key(cfg: Any, key: str, config_name: str) -> str:
    """The message for a key ``cfg`` (composed without it) does not have."""
    from omegaconf import OmegaConf

    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if parent and node is None:  # no such node at all: the leaf may be a top-level key
        near = _closest(leaf, [str(k) for k in cfg.keys() if str(k) != "hydra"])
        return (f"{key}: the {config_name} config has no {parent.split('.')[0]!r} settings"
                + (f"; did you mean {', '.join(near)}=...?" if near else ""))
    keys = [str(k) for k in node.keys() if str(k) != "hydra"] if hasattr(node, "keys") else []
    near = _closest(leaf, keys)
    prefix = f"{parent}." if parent else ""
    group = parent.split(".")[0]
    choice = cfg.hydra.runtime.choices.get(group) if parent else None
    where = f"{group}={choice}" if choice else (parent or f"the {config_name} config")
    hint = (f"did you mean {', '.join(prefix + k for k in near)}?" if near
            else f"its keys: {', '.join(keys)}" if keys else "")
    return (f"{key}: {where} has no key {leaf!r}" + (f"; {hint}" if hint else "")
            + f" (a key of your own takes '+': +{key}=...)")


def _added_like_a_key(cfg: Any, overrides: list[str]) -> list[str]:
    """The lines for keys added with ``+`` that misspell a key beside them in the config
    (``+precison=bf16-mixed`` trained at 32-true, ``+data.image_sise=32`` estimated the
    default size: nothing reads them); a key of the user's own that resembles none
    (``+model.net.width=32``, ``+notes=...``) is left alone, and ``+sweep=`` names a
    group."""

    from omegaconf import OmegaConf

    from remat.config import config_dir

    added = [o.split("=", 1)[0][1:] for o in overrides
             if o.startswith("+") and not o.startswith("++") and "=" in o]
    lines = []
    for key in added:
        parent, _, leaf = key.rpartition(".")
        if not parent and (config_dir() / key).is_dir():
            continue
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if not hasattr(node, "keys"):
            continue
        # the config's own keys there: not this one nor the others the command line adds
        keys = [str(k) for k in node.keys() if str(k) != "hydra"
                and f"{parent}.{k}".lstrip(".") not in added]
        near = _closest(leaf, keys, n=2, cutoff=0.75)  # closer than a key of one's own
        if near:
            prefix = f"{parent}." if parent else ""
            lines.append(f"+{key}: not a key of the config, so nothing reads it; did you "
                         f"mean {' or '.join(f'{prefix}{k}=...' for k in near)} (no '+')?")
    return lines


def exit_on_unknown_key(config_name: str) -> None:
    """Before Hydra composes ``config_name`` from ``sys.argv``: end the process with
    :func:`unknown_key`'s line and exit code 1 when the command line sets a key the config
    lacks (``HYDRA_FULL_ERROR=1`` leaves it to Hydra).

    Raises:
        SystemExit: code 1, after printing ``error: <message>`` on stderr.
    """
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return
    unknown = unknown_key(config_name, sys.argv[1:])
    if unknown is not None:
        print(f"error: {unknown}", file=sys.stderr)
        raise SystemExit(1)

