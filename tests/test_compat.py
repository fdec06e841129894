"""remat._compat: the only module that names private torch internals; the torch floor of
``import remat``; the shims' fallbacks, forced on."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest
import tomllib
import torch
from torch import nn

import remat
from remat import _compat
from tests.helpers import REPO, subprocess_env

SRC = REPO / "src" / "remat"
COMPAT = SRC / "_compat.py"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_private_attributes() -> frozenset[str]:
    """Private attribute names of the torch objects remat code handles without knowing their
    type statically (tensors, storages, modules, ATen overloads, FSDP2 modules), plus the
    attributes torch's checkpoint reads off hook functions."""
    from torch.distributed.fsdp import FSDPModule

    objects = [torch.Tensor, torch.zeros(1), torch.UntypedStorage, nn.Module(), nn.Linear(1, 1),
               nn.BatchNorm2d(1), torch.ops.aten.add, torch.ops.aten.add.Tensor, FSDPModule]
    names = {n for obj in objects for n in dir(obj) if _private(n)}
    return frozenset(names | {"_checkpoint_internal", "_user_hooks"})


def _root(node: ast.AST) -> str | None:
    """The name an attribute chain (``a.b.c``, ``a.b().c``) starts from."""
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_torch_uses(source: str, torch_private: frozenset[str]) -> list[str]:
    """``line: code`` of every use of a private torch name in ``source``: an import of or
    from a private torch module or of a private name from torch; a private attribute reached
    from a name an import bound to torch; a private attribute of a torch object (a name in
    ``torch_private``), also through getattr/hasattr/setattr/delattr with a string."""
    tree = ast.parse(source)
    torch_names: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    torch_names.add(alias.asname or "torch")
                    if any(_private(s) for s in alias.name.split(".")):
                        found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] != "torch":
                continue
            torch_names.update(a.asname or a.name for a in node.names)
            if (any(_private(s) for s in node.module.split("."))
                    or any(_private(a.name) for a in node.names)):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    # ``self.<name>`` is torch's only in a class derived from a torch class
    own_self: set[int] = set()
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef) and not any(
                _root(base) in torch_names for base in cls.bases):
            for fn in ast.walk(cls):
                if isinstance(fn, ast.Attribute) and _root(fn) in ("self", "cls"):
                    own_self.add(id(fn))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node)
            if root in torch_names or (node.attr in torch_private and id(node) not in own_self):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            if node.args[1].value in torch_private or _root(node.args[0]) in torch_names:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def test_the_scan_finds_each_kind_of_private_use():
    torch_private = _torch_private_attributes()
    source = "\n".join([
        "import torch",
        "import torch._dynamo",
        "from torch.utils import checkpoint as ck",
        "from torch.utils._pytree import tree_map",
        "from torch.nn.modules.batchnorm import _NormBase",
        "from torch.utils.checkpoint import CheckpointPolicy",
        "from torch.distributed._tools.mem_tracker import MemTracker",
        "a = torch._C._current_graph_task_id()",
        "b = ck._CheckpointFrame",
        "c = CheckpointPolicy._private_thing",
        "d = t._version + m._buffers['x'].sum()",
        "e = getattr(m, '_get_fsdp_state', None)",
        "f = getattr(ck, '_RECOMPUTE', None)",
        "g = op._schema",
        "pack._checkpoint_internal = True",
        "class Tracker(MemTracker):",
        "    def f(self):",
        "        return self._buffers",
        "class Own:",
        "    def g(self):",
        "        return self._values, self._apply",
        # not torch's: remat's own private names, the standard library, Hydra keys
        "import os",
        "from remat.strategies.selective import _flops",
        "h = self._plan, os._exit, cfg._target_, torch.__version__, ck.checkpoint",
    ])
    found = sorted({int(line.split(":")[0]) for line in private_torch_uses(source, torch_private)})
    assert found == [2, 4, 5, 7, *range(8, 16), 18]


def test_no_module_but_compat_names_a_private_torch_name():
    torch_private = _torch_private_attributes()
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        if path == COMPAT:
            continue
        uses = private_torch_uses(path.read_text(), torch_private)
        if uses:
            offenders[str(path.relative_to(REPO))] = uses
    assert offenders == {}
    # and the compat module does hold them (the scan sees its own shims)
    assert len(private_torch_uses(COMPAT.read_text(), torch_private)) > 20


def test_every_shim_section_names_versions_and_what_retires_it():
    text = COMPAT.read_text()
    sections = text.split("\n# --- ")[1:]
    assert len(sections) >= 5
    for section in sections:
        head = section[:1500]
        assert "torch 2." in head, section.splitlines()[0]
        assert "Retired" in head or "retired" in head, section.splitlines()[0]


# --- the torch floor ----------------------------------------------------------------------


def test_torch_release_reads_major_and_minor():
    assert remat.torch_release("2.14.1+cu130") == (2, 14)
    assert remat.torch_release("2.13.0+cpu") == (2, 13)
    assert remat.torch_release("2.10.0a0+git1234") == (2, 10)
    with pytest.raises(ValueError, match="cannot read a torch version from 'nightly'"):
        remat.torch_release("nightly")


def test_check_torch_refuses_an_older_torch_in_one_line():
    remat.check_torch("2.13.0")
    remat.check_torch("2.14.1+cu130")
    remat.check_torch("3.0.0")
    with pytest.raises(ImportError) as info:
        remat.check_torch("2.12.1")
    assert str(info.value) == ("remat needs torch>=2.13, found torch 2.12.1; install it with: "
                               "pip install 'torch>=2.13'")


def test_check_torch_reads_the_installed_version_through_the_parse(monkeypatch):
    remat.check_torch()  # the torch this suite runs on is in range
    monkeypatch.setattr(remat, "torch_release", lambda version: (2, 9))
    with pytest.raises(ImportError, match=re.escape(f"found torch {torch.__version__};")):
        remat.check_torch()


def test_import_remat_fails_in_one_line_below_the_floor():
    code = "import torch; torch.__version__ = '2.9.1'; import remat.strategies"
    proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "ImportError: remat needs torch>=2.13, found torch 2.9.1; "
        "install it with: pip install 'torch>=2.13'")


def test_floor_is_pyprojects_lower_bound():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_spec = next(d for d in deps if d.startswith("torch") and not d.startswith("torchv"))
    need = ".".join(map(str, remat.TORCH_MIN))
    assert torch_spec.startswith(f"torch>={need},")
    assert f"torch==={need}.0 " in (REPO / "Makefile").read_text()  # CI's oldest-torch job


# --- shims and their fallbacks, forced on --------------------------------------------------


def test_user_hooks_fallback_without_torchs_search(monkeypatch):
    """torch 2.13 has no _current_user_saved_tensors_hooks: the mark sets no user hooks."""
    def pack(t):
        return t

    monkeypatch.delattr(_compat._checkpoint, "_current_user_saved_tensors_hooks",
                        raising=False)
    with torch.autograd.graph.save_on_cpu():
        with _compat.checkpoint_internal_hook(pack):
            assert pack._checkpoint_internal is True
            assert pack._user_hooks is None
    assert not hasattr(pack, "_user_hooks")  # only while on the hooks stack, as torch does


@pytest.mark.skipif(not hasattr(torch.utils.checkpoint, "_current_user_saved_tensors_hooks"),
                    reason="torch 2.13 has no search for the user's hooks (fallback above)")
def test_user_hooks_found_through_torchs_search():
    def pack(t):
        return t

    with torch.autograd.graph.save_on_cpu():
        user = _compat.top_saved_tensors_hooks()
        with _compat.checkpoint_internal_hook(pack):
            assert pack._user_hooks == user


def test_traced_local_loses_only_the_note_when_dynamos_accessor_changes():
    class Tracker:
        value = "the wrap"

    class Local:
        def _i_will_not_complain_if_bc_breaks_VariableTracker(self):
            return Tracker()

    class Ctx:
        def __init__(self, local):
            self.local = local

        def get_local(self, name):
            if name != "wrap":
                raise KeyError(name)
            return self.local

    assert _compat.traced_local(Ctx(Local()), "wrap") == "the wrap"
    assert _compat.traced_local(Ctx(object()), "wrap") is None  # accessor renamed
    assert _compat.traced_local(Ctx(Local()), "other") is None


def test_traced_local_under_a_real_compile_marks_the_wrap():
    # in a child: a compiled backward in this process would leave autograd unable to run in
    # the forked children of later tests (remat.measure.trace)
    code = "\n".join([
        "import torch",
        "from torch import nn",
        "from remat.strategies.full import FullCheckpoint",
        "from remat.strategies.wrapping import wraps_of",
        "model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))",
        "FullCheckpoint().apply(model, ['0'])",
        "wrap = next(w for _, _, w in wraps_of(model))",
        "print(wrap.traced)",
        "compiled = torch.compile(model, backend='eager')",
        "compiled(torch.randn(3, 4, requires_grad=True)).sum().backward()",
        "print(wrap.traced)",
    ])
    proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"]


def test_early_stop_follows_torchs_setting(monkeypatch):
    def recompute():
        return None

    def error(err):
        raise err

    monkeypatch.setattr(torch.utils.checkpoint, "_enable_checkpoint_early_stop", None)
    assert _compat.new_checkpoint_frame(recompute, error).early_stop is True
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        frame = _compat.new_checkpoint_frame(recompute, error)
    assert frame.early_stop is False
    assert frame.recompute_fn is recompute and frame.unpack_error_cb is error
    meta = frame.metadata_fn(torch.zeros(2, 3))
    assert meta["shape"] == torch.Size([2, 3]) and meta["dtype"] == torch.float32


def test_op_schema_and_storage_identity():
    schema = _compat.op_schema(torch.ops.aten.add_.Tensor)
    assert schema.is_mutable and [a.name for a in schema.arguments][:2] == ["self", "other"]
    assert _compat.op_schema(len, missing_ok=True) is None
    with pytest.raises(AttributeError):
        _compat.op_schema(len)
    x = torch.zeros(4)
    view = x[1:]
    assert _compat.storage_id(view) == _compat.storage_id(x) != _compat.storage_id(x.clone())
    assert _compat.view_base(view) is x and _compat.view_base(x) is None
    before = _compat.tensor_version(x)
    x.add_(1)
    assert _compat.tensor_version(x) == before + 1


def test_module_tables_are_the_live_ones():
    net = nn.Sequential(nn.BatchNorm1d(3))
    bn = net[0]
    assert list(_compat.child_table(net)) == ["0"]
    assert set(_compat.parameter_table(bn)) == {"weight", "bias"}
    copy = torch.full((3,), 5.0)
    _compat.buffer_table(bn)["running_mean"] = copy
    assert bn.running_mean is copy
    assert isinstance(bn, _compat.NormBase) and not isinstance(nn.LayerNorm(3), _compat.NormBase)

    def hook(module, args, out):
        return out

    net.register_forward_hook(hook)
    net.register_forward_hook(hook, always_call=True, with_kwargs=True)
    _compat.remove_forward_hook(net, hook)
    assert len(net._forward_hooks) == 0
    assert len(net._forward_hooks_always_called) == 0
    assert len(net._forward_hooks_with_kwargs) == 0


def test_in_backward_and_inside_checkpoint():
    seen = {}

    def probe(x):
        seen.setdefault("inside", _compat.inside_checkpoint())
        return x * 2

    x = torch.ones(2, requires_grad=True)
    assert not _compat.in_backward() and not _compat.inside_checkpoint()
    y = torch.utils.checkpoint.checkpoint(probe, x, use_reentrant=False)
    assert seen["inside"] is True

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            seen["backward"] = _compat.in_backward()
            return grad

    Probe.apply(y).sum().backward()
    assert seen["backward"] is True


def test_inside_checkpoint_without_torchs_mark(monkeypatch):
    """torch 2.13 does not mark its checkpoint's pack hooks: they are known by name."""
    def pack_hook(t):
        return t

    def unpack(t):
        return t

    pack_hook.__module__ = "torch.utils.checkpoint"
    for qualname, inside in [("_checkpoint_hook.__init__.<locals>.pack_hook", True),
                             ("_recomputation_hook.__init__.<locals>.pack_hook", True),
                             ("save_on_cpu.__init__.<locals>.pack_to_cpu", False)]:
        pack_hook.__qualname__ = qualname
        monkeypatch.setattr(_compat, "top_saved_tensors_hooks", lambda: (pack_hook, unpack))
        assert _compat.inside_checkpoint() is inside, qualname
    pack_hook.__module__ = "my_package"
    pack_hook.__qualname__ = "_checkpoint_hook.__init__.<locals>.pack_hook"
    assert _compat.inside_checkpoint() is False
    monkeypatch.undo()
    with torch.autograd.graph.save_on_cpu():
        assert _compat.inside_checkpoint() is False


def test_a_unit_inside_a_users_checkpoint_is_not_checkpointed_again():
    """Only the outermost checkpoint recomputes: a wrapped unit called inside a plain torch
    checkpoint runs as it is, on every torch in range."""
    from remat.strategies.full import FullCheckpoint
    from remat.strategies.wrapping import wraps_of

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    FullCheckpoint().apply(model, ["0"])
    model.train()
    wrap = next(w for _, _, w in wraps_of(model))
    x = torch.randn(3, 4, requires_grad=True)
    torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False).sum().backward()
    assert wrap.calls == 0  # run_recomputed counts only calls it checkpoints itself
    model(x).sum().backward()
    assert wrap.calls == 1


def test_compile_shims():
    assert _compat.lookup_backend("eager") is _compat.lookup_backend("eager")
    assert "inductor" in _compat.list_backends()
    assert "max-autotune" in _compat.inductor_mode_options()
    assert isinstance(dict(_compat.inductor_mode_options("max-autotune", None)), dict)
    config = _compat.functorch_config()
    with config.patch(activation_memory_budget=0.25):
        assert config.activation_memory_budget == 0.25
    assert hasattr(config, "joint_custom_pass")


def test_sac_cache_layout_is_the_one_selective_rewrites():
    """The forward context's cache is {key: {call index: entry}} and an entry may be
    ``SAC_RECOMPUTE`` (what remat.strategies.selective writes into it)."""
    def policy(ctx, op, *args, **kwargs):
        return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE

    forward, _ = torch.utils.checkpoint.create_selective_checkpoint_contexts(policy)
    x = torch.randn(3, 3, requires_grad=True)
    with forward:
        torch.mm(x, x)
        torch.mm(x, x)
    cache = _compat.sac_cache(forward)
    key = _compat.sac_storage_key(torch.ops.aten.mm.default, (x, x))
    assert sorted(cache[key]) == [0, 1]
    assert hasattr(cache[key][0], "get_val")
    assert _compat.SAC_RECOMPUTE is not None


def test_fake_process_group_store_and_allocation_tag():
    assert type(_compat.fake_process_group_store()).__name__ == "FakeStore"
    assert str(_compat.allocation_event_tag()).endswith("Allocation")


def test_global_peak_tracker_counts_a_known_allocation():
    tracker = _compat.global_peak_tracker_class()()
    with tracker:
        a = torch.zeros(1024, dtype=torch.float32)  # 4 KiB
        b = torch.zeros(2048, dtype=torch.float32)  # 8 KiB
        del a, b
    peak = tracker.get_tracker_snapshot("peak")
    total = sum(v for dev, snap in peak.items() for k, v in snap.items() if k == "Total")
    assert total == 12288


def test_compat_is_importable_without_running_anything_slow():
    code = ("import sys, remat._compat; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"

