"""State a unit's forward reads or writes outside its arguments: the replay sees what the
forward saw, and writes nothing the forward did not.

Three kinds that gave other gradients without an error before (public bug kinds of VQ
layers, stochastic modules and meta-learning):

- a buffer updated through ``.data`` (the EMA codebook of a VQ-VAE layer), which bumps no
  version counter;
- random numbers drawn from a ``torch.Generator`` the module holds (or one passed to it);
- ``torch.func.functional_call(model, other_params, ...)`` (MAML's fast weights, an
  ensemble's members): the call swaps the parameters back before backward recomputes.

Every recomputing strategy of the registry is checked against ``none``: outputs, gradients,
buffers and the generators' states after two steps.
"""

from __future__ import annotations

import enum

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from remat.strategies import (
    STRATEGIES,
    RecomputeError,
    RecomputeStrategy,
    StageError,
    build_strategy,
)
from tests.strategies.common import sgd_steps

#: every recomputing strategy of the registry, with arguments that make real segments
RECOMPUTING = [(name, {"segments": "sqrtn"} if name == "offload" else
                {"k": 2} if name == "every_k" else {})
               for name, cls in STRATEGIES.items() if issubclass(cls, RecomputeStrategy)]
WIDTH = 8


class EMACodebook(nn.Module):
    """A VQ layer's EMA codebook: the nearest code replaces the input (straight-through)
    and the codebook moves toward the inputs through ``.data`` (``how`` picks the idiom)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("codes", torch.randn(4, WIDTH))
        self.how = how

    def forward(self, x):
        z = self.fc(x)
        nearest = torch.cdist(z.detach(), self.codes).argmin(dim=1)
        q = self.codes[nearest]
        if self.training:
            mean = z.detach().mean(0, keepdim=True)
            if self.how == "mul_add":
                self.codes.data.mul_(0.9).add_(0.1 * mean)
            elif self.how == "assign":
                self.codes.data = 0.9 * self.codes + 0.1 * mean
            else:  # copy_
                self.codes.data.copy_(0.9 * self.codes + 0.1 * mean)
        return x + z + (q - z).detach() * z.sigmoid()


class OwnGenerator(nn.Module):
    """Noise from the module's own generator (a stochastic layer seeded apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, x):
        noise = torch.rand(x.shape, generator=self.gen)
        return x + F.gelu(self.fc(x)) * noise


class GivenGenerator(nn.Module):
    """Noise from a generator the parent passes as an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, gen=None):
        return x + F.gelu(self.fc(x)) * torch.rand(x.shape, generator=gen)


class Chain(nn.Module):
    def __init__(self, make, n: int = 4, gen: torch.Generator | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(make() for _ in range(n))
        self.gen = gen

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x, gen=self.gen) if self.gen is not None else blk(x)
        return x


class MAML(nn.Module):
    """One inner SGD step on fast weights, then the query loss through
    ``functional_call`` with them (the model's own parameters are not used)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Chain(lambda: Residual(), n=4)

    def forward(self, x):
        params = dict(self.net.named_parameters())
        inner = functional_call(self.net, params, (x,)).square().mean()
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        fast = {n: p - 0.5 * g for (n, p), g in zip(params.items(), grads, strict=True)}
        return functional_call(self.net, fast, (x,))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Ensemble(nn.Module):
    """One network called with each member's parameters (another model's ``Parameter``s)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Chain(lambda: Residual(), n=4)
        self.members = nn.ModuleList(Chain(lambda: Residual(), n=4) for _ in range(2))

    def forward(self, x):
        outs = [functional_call(self.net, dict(m.named_parameters()), (x,))
                for m in self.members]
        return sum(outs) + self.net(x)


def _generators(model: nn.Module) -> list[torch.Tensor]:
    gens = [v for m in model.modules() for v in vars(m).values()
            if isinstance(v, torch.Generator)]
    return [g.get_state() for g in gens]


def _steps(model: nn.Module, x: torch.Tensor, steps: int = 2):
    """:func:`sgd_steps` and the states of the generators the modules hold after them."""
    return (*sgd_steps(model, x, steps), _generators(model))


def _assert_same_function(make, stages, x, refused: dict[str, str] | None = None):
    """Each recomputing strategy gives ``none``'s function on ``make()``, or (``refused``:
    strategy -> words of the message) raises a :class:`RecomputeError` naming the unit."""
    def fresh() -> nn.Module:  # built again, not deep-copied (TorchScript modules)
        torch.manual_seed(0)
        return make()

    ref = _steps(fresh(), x)
    for name, overrides in RECOMPUTING:
        model = fresh()
        build_strategy(name, **overrides).apply(model, stages)
        if name in (refused or {}):
            with pytest.raises(RecomputeError) as err:
                _steps(model, x)
            assert f"'{stages[0]}." in str(err.value) and refused[name] in str(err.value)
            continue
        got = _steps(model, x)
        assert torch.equal(got[0], ref[0]), name
        assert got[1].keys() == ref[1].keys(), name
        for key, grad in ref[1].items():
            torch.testing.assert_close(got[1][key], grad, rtol=1e-5, atol=1e-6,
                                       msg=f"{name}: {key}")
        for key, value in ref[2].items():
            assert torch.equal(got[2][key], value), f"{name}: buffer {key}"
        assert len(got[3]) == len(ref[3]), name
        for after, expected in zip(got[3], ref[3], strict=True):
            assert torch.equal(after, expected), f"{name}: generator state"


@pytest.mark.parametrize("how", ["mul_add", "assign", "copy_"])
def test_a_buffer_updated_through_data_is_updated_once_per_forward(how):
    """The EMA codebook moves once per step, as without remat, and the replay quantises with
    the codes the forward used (its gradients differed by 2.9e-3 before)."""
    _assert_same_function(lambda: Chain(lambda: EMACodebook(how)), ["blocks"],
                          torch.randn(6, WIDTH))


def test_a_modules_own_generator_draws_the_same_numbers_in_the_replay():
    """The replay draws the forward's numbers and leaves the generator where the forward
    left it (gradients differed by up to 0.23 before)."""
    _assert_same_function(lambda: Chain(OwnGenerator), ["blocks"], torch.randn(6, WIDTH))


def test_a_generator_passed_as_an_argument_draws_the_same_numbers_in_the_replay():
    _assert_same_function(lambda: Chain(GivenGenerator, gen=torch.Generator().manual_seed(9)),
                          ["blocks"], torch.randn(6, WIDTH))


def test_functional_call_with_fast_weights_recomputes_with_them():
    """MAML: the query pass runs on fast weights; the replay must use those, not the
    parameters ``functional_call`` restored (gradients differed by 0.29 before). Under
    ``selective`` these blocks cache no op output (none is one autograd saves and the
    recompute can hold beside the rest), so the outer step's second backward runs too; a
    block that does cache is refused for a second backward (test_selective)."""
    _assert_same_function(MAML, ["net.blocks"], torch.randn(6, WIDTH))


def test_functional_call_with_another_models_parameters_recomputes_with_them():
    _assert_same_function(Ensemble, ["net.blocks"], torch.randn(6, WIDTH))


class Counted(nn.Module):
    """A block whose forward reads two plain attributes: ``scale``, which its parent sets
    before each call, and ``calls``, which the forward itself counts."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.scale = 1.0
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + torch.tanh(self.fc(x) * self.scale * (1 + 0.1 * self.calls))


class ScaledCalls(nn.Module):
    """Each block called three times with another ``scale``, then ``scale`` changed again
    after the forward, before backward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Counted() for _ in range(2))

    def forward(self, x):
        for step in range(3):
            for blk in self.blocks:
                blk.scale = 1.0 + step
                x = blk(x)
        for blk in self.blocks:
            blk.scale = 5.0
        return x


def test_attributes_the_parent_or_the_forward_change_are_replayed_as_they_were():
    """A replay sets each call's plain attributes to their values before that call in the
    forward and puts back the current ones: gradients differed by 6.8 before (the replay read
    the last ``scale`` and counted ``calls`` on from where the forward stopped), and each
    replay added to ``calls`` (6 after one step where the forward counted 3)."""
    _assert_same_function(ScaledCalls, ["blocks"], torch.randn(6, WIDTH))
    for name, overrides in RECOMPUTING:
        torch.manual_seed(0)
        model = ScaledCalls()
        build_strategy(name, **overrides).apply(model, ["blocks"])
        sgd_steps(model, torch.randn(6, WIDTH), steps=2)
        assert [blk.calls for blk in model.blocks] == [6, 6], name
        assert [blk.scale for blk in model.blocks] == [5.0, 5.0], name


class Mode(enum.Enum):
    SOFT = 1
    HARD = 2


class Settings(nn.Module):
    """A block reading settings of other kinds: an enum member, a numpy scalar, a 0-d
    tensor, and a flag its first call sets (absent before it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.mode = Mode.SOFT
        self.gain = np.float32(1.0)
        self.shift = torch.tensor(0.0)

    def forward(self, x):
        warm = 2.0 if hasattr(self, "warm") else 1.0
        self.warm = True
        y = self.fc(x) * float(self.gain) * warm + self.shift
        return x + (torch.tanh(y) if self.mode is Mode.SOFT else torch.sigmoid(y))


class SettingsChanged(nn.Module):
    """Each block called twice, its settings changed before backward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Settings() for _ in range(2))

    def forward(self, x):
        for _ in range(2):
            for blk in self.blocks:
                x = blk(x)
        for blk in self.blocks:
            blk.mode, blk.gain, blk.shift = Mode.HARD, np.float32(3.0), torch.tensor(0.5)
        return x


def test_settings_of_other_kinds_and_a_first_call_flag_are_replayed_as_they_were():
    """Enum members, numpy scalars, small tensors replaced, and a flag the first call adds
    (a trial's gradients differed by 0.19-0.96 under every recomputing strategy)."""
    def make():
        torch.manual_seed(0)
        return SettingsChanged()

    x = torch.randn(6, WIDTH)
    ref = make()
    ref(x).square().mean().backward()
    for name, overrides in RECOMPUTING:
        model = make()
        build_strategy(name, **overrides).apply(model, ["blocks"])
        model(x).square().mean().backward()
        for (key, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6,
                                       msg=f"{name}: {key}")
        assert all(blk.warm is True and blk.mode is Mode.HARD for blk in model.blocks), name


def test_eval_between_forward_and_backward_replays_in_training_mode():
    """``model.eval()`` after the forward (a validation hook before backward): the replay
    runs each call as the forward did, with batch statistics and the same dropout masks."""
    def run(name, overrides):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH),
                                              nn.Dropout(0.3), nn.Tanh()) for _ in range(4)])
        if name is not None:
            build_strategy(name, **overrides).apply(model, [""])
        torch.manual_seed(1)
        out = model.train()(torch.randn(8, WIDTH))
        model.eval()
        out.square().sum().backward()
        return {n: p.grad for n, p in model.named_parameters()}, model.state_dict()

    grads, state = run(None, {})
    for name, overrides in RECOMPUTING:
        got, got_state = run(name, overrides)
        for key, grad in grads.items():
            assert torch.equal(got[key], grad), f"{name}: {key}"
        for key, value in state.items():
            assert torch.equal(got_state[key], value), f"{name}: {key}"


class ScriptedInside(nn.Module):
    """An eager block whose MLP is a TorchScript module (torch.jit.script)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.mlp = torch.jit.script(nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                                  nn.Linear(2 * WIDTH, WIDTH)))

    def forward(self, x):
        return x + self.mlp(torch.tanh(self.fc(x)))


def test_torchscript_inside_an_eager_unit_recomputes():
    """The replay runs a scripted submodule to its end (torch's early stop, raised inside
    the TorchScript interpreter, came back as an empty RuntimeError at the first backward)."""
    _assert_same_function(lambda: Chain(ScriptedInside), ["blocks"], torch.randn(6, WIDTH))


def test_a_scripted_chain_member_is_refused_naming_it():
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH),
                          nn.Sequential(torch.jit.script(Residual()), Residual()))
    for name, overrides in RECOMPUTING:
        with pytest.raises(StageError) as err:
            build_strategy(name, **overrides).apply(model, ["1"])
        assert "'1.0'" in str(err.value) and "TorchScript" in str(err.value), name
