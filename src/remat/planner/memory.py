"""Memory budgets as users write them: ``12GiB``, ``12 GB``, ``800MiB``, bytes, or ``0.8``."""

from __future__ import annotations

import math
import re
from typing import Any


class PlanInputError(ValueError):
    """A bad planner setting (``strategy.memory``, ``strategy.device``, ``margin``,
    ``objective``, ``effective_batch_size``, ...): the message names the key and says what
    is expected. ``python train.py`` and ``python -m remat.plan`` report it in one line
    (exit code 1)."""

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$",
                      re.IGNORECASE)


def parse_memory(value: Any, device_memory: int | None = None,
                 key: str = "strategy.memory") -> int:
    """Bytes of a memory budget.

    Accepts an int (bytes), a number in ``(0, 1]`` (a fraction of ``device_memory``), or a
    string: a number with an optional unit, ``B``, decimal ``KB MB GB TB`` (1e3..1e12),
    binary ``KiB MiB GiB TiB`` (and the short ``K M G T``, binary as in ``nvidia-smi``),
    case-insensitive, spaces allowed (``12GiB``, ``12 GB``, ``1.5e10``).

    Raises:
        ValueError: unparseable, zero or negative, a fraction without ``device_memory``, or
            more than ``device_memory`` (when given); the message names ``key``.
    """
    if isinstance(value, bool) or value is None:
        raise PlanInputError(f"{key}={value!r}: give a memory budget such as 12GiB, '12 GB', a "
                         "number of bytes, or a fraction of the device's memory such as 0.8")
    if isinstance(value, int | float):
        number, unit = float(value), None
    else:
        match = _PATTERN.match(str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise PlanInputError(f"{key}={value!r}: cannot read a memory size; use e.g. 12GiB, "
                             "'12 GB', 800MiB, 24000000000 (bytes) or 0.8 (a fraction of the "
                             "device's memory)")
        number, unit = float(match.group(1)), match.group(2).lower()
    if not math.isfinite(number):
        raise PlanInputError(f"{key}={value!r}: a memory budget must be a finite size, such as "
                         "12GiB or 0.8 (a fraction of the device's memory)")
    if number <= 0:
        raise PlanInputError(f"{key}={value!r}: a memory budget must be > 0")
    is_int = isinstance(value, int) or (isinstance(value, str) and "." not in value
                                        and "e" not in value.lower())
    if (unit is None or unit == "") and not is_int and number > 1 and not number.is_integer():
        raise PlanInputError(f"{key}={value!r}: a fraction of the device's memory must be in "
                         "(0, 1]; give bytes as an integer or a size such as 12GiB")
    if unit is None or unit == "":
        if number <= 1 and not is_int:
            if device_memory is None:
                raise PlanInputError(f"{key}={value!r} is a fraction of the device's memory, but "
                                 "the device's memory is not known; give bytes or a size "
                                 "such as 12GiB")
            budget = int(number * device_memory)
        else:
            budget = int(number)
    else:
        budget = int(number * _UNITS[unit])
    if budget < 2**20:
        raise PlanInputError(f"{key}={value!r} is {budget} bytes, less than 1 MiB, which "
                         "holds no training step: give a size such as 800MiB or 12GiB, or a "
                         "fraction of the device's memory (0.8)")
    if device_memory is not None and device_memory > 0 and budget > device_memory:
        raise PlanInputError(f"{key}={value!r} ({budget / 2**30:.2f} GiB) is more than the "
                         f"device's memory ({device_memory / 2**30:.2f} GiB)")
    return budget
