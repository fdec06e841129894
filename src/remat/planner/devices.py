"""Devices the planner can plan for: memory, peak FLOP/s and memory bandwidth.

The planner's time model is a roofline per op (Williams et al. 2009, "Roofline: an
insightful visual performance model", CACM 52(4)): ``max(FLOPs / peak FLOP/s, bytes /
bandwidth)``. Only ratios between plans of one model on one device are used (recompute time
over the step's time), so the figures need to be right relative to each other, not exact.

Figures are the vendors' datasheet numbers (dense, no structured sparsity). ``fp32`` is the
non-tensor-core FP32 rate (torch's default for matmuls, ``allow_tf32=False``); ``bf16`` is
the BF16 tensor-core rate with FP32 accumulation, used for ``bf16-mixed`` and ``16-mixed``.
Memory is the datasheet capacity in decimal GB (1e9 bytes); on a present GPU the planner
uses ``torch.cuda.get_device_properties(...).total_memory`` instead.

``host_bandwidth`` is the link between the GPU and host memory, one direction (bytes/s):
half the bidirectional PCIe figure the datasheets give (PCIe Gen5 x16: 128 GB/s both ways,
Gen4 x16: 64 GB/s). The planner's ``offload`` mode moves a recompute segment's kept inputs
over it, to host memory after the forward and back before the recompute.

``cpu`` has no table row: its FLOP/s and bandwidth are measured on this machine when a plan
asks for them (:func:`calibrate_cpu`: a float32 matmul and a large copy, a fraction of a
second, measured once per machine and kept on disk so plans are reproducible), and its
memory is the machine's RAM (``os.sysconf``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from remat.planner.memory import PlanInputError

GB = 10**9
TFLOPS = 10**12
GBPS = 10**9


@dataclass(frozen=True)
class DeviceSpec:
    """One device's figures.

    Attributes:
        name: the key used in ``strategy.device=`` / ``device=`` (e.g. ``h100``).
        title: the product name.
        memory_bytes: device memory (bytes).
        fp32_flops: peak FP32 FLOP/s (no tensor cores).
        bf16_flops: peak BF16 tensor-core FLOP/s, dense.
        bandwidth: peak memory bandwidth (bytes/s).
        source: where the figures come from.
        host_bandwidth: device <-> host memory link, one direction (bytes/s); 0 where
            tensors cannot be moved off the device (``cpu``: they already are in host
            memory), which leaves the planner's ``offload`` mode out.
    """

    name: str
    title: str
    memory_bytes: int
    fp32_flops: float
    bf16_flops: float
    bandwidth: float
    source: str
    host_bandwidth: float = 0.0

    def flops_for(self, precision: str) -> float:
        """Peak FLOP/s used for ``precision`` (``32-true`` -> FP32, mixed -> BF16/FP16)."""
        return self.fp32_flops if precision in ("32-true", "32", "64-true") else self.bf16_flops

    def to_dict(self) -> dict:
        return asdict(self)


_H100 = "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"
DEVICES: dict[str, DeviceSpec] = {d.name: d for d in (
    DeviceSpec("h100", "NVIDIA H100 SXM5 80GB", 80 * GB, 67 * TFLOPS, 989 * TFLOPS,
               3350 * GBPS, _H100, 64 * GBPS),
    DeviceSpec("h100_pcie", "NVIDIA H100 PCIe 80GB", 80 * GB, 51 * TFLOPS, 756 * TFLOPS,
               2000 * GBPS, "NVIDIA H100 Tensor Core GPU datasheet (PCIe)", 64 * GBPS),
    DeviceSpec("h200", "NVIDIA H200 SXM 141GB", 141 * GB, 67 * TFLOPS, 989 * TFLOPS,
               4800 * GBPS, "NVIDIA H200 Tensor Core GPU datasheet (SXM)", 64 * GBPS),
    DeviceSpec("a100_40gb", "NVIDIA A100 SXM4 40GB", 40 * GB, 19.5 * TFLOPS, 312 * TFLOPS,
               1555 * GBPS, "NVIDIA A100 Tensor Core GPU datasheet (40GB SXM)", 32 * GBPS),
    DeviceSpec("a100_80gb", "NVIDIA A100 SXM4 80GB", 80 * GB, 19.5 * TFLOPS, 312 * TFLOPS,
               2039 * GBPS, "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)", 32 * GBPS),
    DeviceSpec("l4", "NVIDIA L4 24GB", 24 * GB, 30.3 * TFLOPS, 121 * TFLOPS, 300 * GBPS,
               "NVIDIA L4 Tensor Core GPU datasheet", 32 * GBPS),
    DeviceSpec("rtx4090", "NVIDIA GeForce RTX 4090 24GB", 24 * GB, 82.6 * TFLOPS,
               165.2 * TFLOPS, 1008 * GBPS,
               "NVIDIA Ada Lovelace GPU architecture whitepaper (RTX 4090, FP32 accumulate); "
               "host link: PCI Express 4.0 x16 (PCI-SIG, 16 GT/s per lane)", 32 * GBPS),
)}

#: Names a present GPU's ``torch.cuda.get_device_name`` is matched against (lower case).
_CUDA_NAMES = (("h200", "h200"), ("h100 pcie", "h100_pcie"), ("h100", "h100"),
               ("a100-sxm4-40gb", "a100_40gb"), ("a100-pcie-40gb", "a100_40gb"),
               ("a100", "a100_80gb"), ("l4", "l4"), ("4090", "rtx4090"))


def known_devices() -> list[str]:
    """Every name :func:`get_device` accepts."""
    return [*DEVICES, "cpu", "auto"]


def _unknown(name: str, key: str) -> PlanInputError:
    return PlanInputError(
        f"{key}={name!r}: unknown device; known: {', '.join(known_devices())}. For another "
        f"device give its figures by hand: {key}={{name: mygpu, memory_bytes: 48e9, "
        "fp32_flops: 40e12, bf16_flops: 300e12, bandwidth: 1.5e12, host_bandwidth: 32e9} "
        "(FLOP/s and bytes/s; host_bandwidth, the PCIe link one way, is optional: without it "
        "nothing is offloaded)")


#: where :func:`calibrate_cpu` keeps its figures: ``$REMAT_CACHE_DIR``, else
#: ``~/.cache/remat``
CACHE_ENV = "REMAT_CACHE_DIR"
_REPEATS = 9


def _cpu_key(threads: int) -> str:
    """What the figures depend on: the CPU model, the threads torch uses, torch's version."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle
                          if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} | {threads} threads | torch {torch.__version__}"


def _measure_cpu() -> tuple[float, float]:
    """Float32 matmul FLOP/s and copy bandwidth (bytes/s): the fastest of
    :data:`_REPEATS` timings of a 1024x1024 matmul and of a 64 MiB copy (read + write),
    after one warm-up each (the fastest is the least disturbed by other load)."""
    # its own generator: a BudgetStrategy calibrates when it is built, before the run draws
    # the network's weights, which must be those of the same run without a budget
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(1024, 1024, generator=generator)
    b = torch.randn(1024, 1024, generator=generator)
    src = torch.empty(16 * 2**20)
    dst = torch.empty_like(src)
    best_mm = best_copy = float("inf")
    torch.mm(a, b)
    dst.copy_(src)
    for _ in range(_REPEATS):
        start = time.perf_counter()
        torch.mm(a, b)
        best_mm = min(best_mm, time.perf_counter() - start)
        start = time.perf_counter()
        dst.copy_(src)
        best_copy = min(best_copy, time.perf_counter() - start)
    return 2 * 1024**3 / best_mm, 2 * src.numel() * src.element_size() / best_copy


@functools.cache
def calibrate_cpu(threads: int | None = None) -> tuple[float, float]:
    """This CPU's float32 matmul FLOP/s and copy bandwidth (bytes/s), measured once per
    machine (:func:`_measure_cpu`) and kept in ``<cache>/cpu_calibration.json`` under the
    CPU model, thread count and torch version, so that plans for this CPU are the same from
    one run to the next (a measurement per process made them depend on the machine's load).
    Delete the file to measure again. Cached per process too.
    """
    threads = int(threads or torch.get_num_threads())
    folder = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "remat")
    path = folder / "cpu_calibration.json"
    key = _cpu_key(threads)
    try:
        known = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        known = {}
    entry = known.get(key)
    if isinstance(entry, dict) and entry.get("fp32_flops") and entry.get("bandwidth"):
        return float(entry["fp32_flops"]), float(entry["bandwidth"])
    flops, bandwidth = _measure_cpu()
    known[key] = {"fp32_flops": flops, "bandwidth": bandwidth}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)  # atomic: two processes calibrating at once leave one whole file
    except OSError:
        pass  # a read-only home: measured per process, as before
    return flops, bandwidth


def cpu_spec() -> DeviceSpec:
    """This machine's CPU: calibrated FLOP/s and bandwidth, RAM as memory."""
    flops, bandwidth = calibrate_cpu()
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        memory = 0
    return DeviceSpec("cpu", "this CPU (calibrated)", int(memory), flops, flops, bandwidth,
                      f"measured here: 1024x1024 float32 matmul and a 64 MiB copy, best of "
                      f"{_REPEATS}, kept per machine ({_cpu_key(torch.get_num_threads())})")


def _present_cuda() -> DeviceSpec | None:
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    lower = props.name.lower()
    for needle, name in _CUDA_NAMES:
        if needle in lower:
            base = DEVICES[name]
            return DeviceSpec(base.name, props.name, int(props.total_memory), base.fp32_flops,
                              base.bf16_flops, base.bandwidth,
                              base.source + "; memory from torch.cuda.get_device_properties",
                              base.host_bandwidth)
    return None


def present_device_name(accelerator: str = "auto") -> str:
    """The device-table name of what a run with ``trainer.accelerator=accelerator`` trains
    on: ``cpu`` for ``cpu`` (or ``auto``/``gpu``/``cuda`` without CUDA), the present GPU's
    name in :data:`DEVICES` (``h100``, ``l4``, ...) else, or, for a GPU not in the table, its
    ``torch.cuda.get_device_name`` in lower case; another accelerator (``mps``) as given."""
    kind = str(accelerator).strip().lower()
    if kind == "cpu" or (kind in ("auto", "gpu", "cuda") and not torch.cuda.is_available()):
        return "cpu"
    if kind not in ("auto", "gpu", "cuda"):
        return kind
    present = _present_cuda()
    return present.name if present is not None else torch.cuda.get_device_name().lower()


def _figure(fields: dict, name: str, key: str) -> float:
    """``fields[name]`` as a finite number > 0.

    Raises:
        PlanInputError: naming ``key.name``: not a number (a bool too), not finite, or <= 0.
    """
    value = fields[name]
    try:
        if isinstance(value, bool):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        raise PlanInputError(f"{key}.{name}: must be a number (bytes, FLOP/s or bytes/s), "
                             f"got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise PlanInputError(f"{key}.{name}={value!r}: must be a finite number > 0")
    return number


def get_device(device: str | dict | DeviceSpec, key: str = "strategy.device") -> DeviceSpec:
    """The :class:`DeviceSpec` for a name, a mapping of figures, or ``auto``.

    ``auto`` is the GPU present if it is in the table, else ``cpu`` (calibrated). A mapping
    gives a device by hand: ``name``, ``memory_bytes``, ``fp32_flops``, ``bf16_flops``,
    ``bandwidth`` (``title``, ``source`` and ``host_bandwidth`` optional; without
    ``host_bandwidth`` the planner does not offload).

    Raises:
        ValueError: unknown name (the message lists the known ones and how to give figures by
            hand), a mapping missing figures or with a figure that is not a finite number
            > 0 (``host_bandwidth`` may be left out or null: no host link), a present GPU
            not in the table under ``auto``.
    """
    if isinstance(device, DeviceSpec):
        return device
    if isinstance(device, dict) or hasattr(device, "items"):
        fields = dict(device.items())
        need = ("name", "memory_bytes", "fp32_flops", "bf16_flops", "bandwidth")
        missing = [k for k in need if k not in fields]
        if missing:
            raise PlanInputError(f"{key}: a device given by hand needs {', '.join(need)}; "
                             f"missing {', '.join(missing)}")
        figures = {k: _figure(fields, k, key) for k in need[1:]}
        host = fields.get("host_bandwidth")
        return DeviceSpec(str(fields["name"]), str(fields.get("title", fields["name"])),
                          int(figures["memory_bytes"]), figures["fp32_flops"],
                          figures["bf16_flops"], figures["bandwidth"],
                          str(fields.get("source", "given by hand")),
                          0.0 if host is None else _figure(fields, "host_bandwidth", key))
    name = str(device).strip().lower().replace("-", "_")
    if name == "auto":
        present = _present_cuda()
        if present is not None:
            return present
        if torch.cuda.is_available():
            raise PlanInputError(f"{key}=auto: the GPU here ({torch.cuda.get_device_name()}) is "
                             f"not in the device table; name one ({', '.join(DEVICES)}) or "
                             "give its figures by hand")
        return cpu_spec()
    if name == "cpu":
        return cpu_spec()
    if name in DEVICES:
        return DEVICES[name]
    raise _unknown(str(device), key)
