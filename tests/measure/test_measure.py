"""remat.measure: per-category peak split, gradient parity, autocast choice."""

import pytest
import torch
from torch import nn

from remat.measure import (
    PeakMemory,
    compare_gradients,
    gradients_of,
    step_peak_memory,
    training_step,
)


class Tiny(nn.Module):
    """Two linear layers; ``training_loss`` on ``{"x": [B, 256]}``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(256, 512), nn.Linear(512, 1)

    def training_loss(self, batch):
        return self.b(torch.relu(self.a(batch["x"]))).square().mean()


def test_step_peak_is_split_by_category_with_exact_parameter_bytes():
    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.Adam(model.parameters())
    peak = step_peak_memory(model, {"x": torch.randn(64, 256)}, optimizer, "cpu")
    cats = peak.categories
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert cats["parameters"] == param_bytes
    # Adam's first step: exp_avg and exp_avg_sq, one each per parameter
    assert cats["optimizer_state"] >= 2 * param_bytes
    assert sum(v for k, v in cats.items() if k != "total") == cats["total"] == peak.peak_bytes


def test_split_false_reports_only_the_total():
    model = Tiny()
    with PeakMemory("cpu", modules=[model], split=False) as peak:
        model.training_loss({"x": torch.randn(8, 256)}).backward()
    assert set(peak.categories) == {"total"} and peak.peak_bytes > 0
    assert peak.reserved_bytes is None  # allocator figure only on CUDA


def test_activations_grow_with_the_batch():
    model = Tiny()
    small = step_peak_memory(model, {"x": torch.randn(16, 256)}, None, "cpu").categories
    large = step_peak_memory(model, {"x": torch.randn(256, 256)}, None, "cpu").categories
    # the hidden layer output (512 floats per sample) and its relu are kept for backward
    assert large["activations"] - small["activations"] >= (256 - 16) * 512 * 4


def test_gradient_parity_detects_a_difference_and_names_the_parameter():
    torch.manual_seed(0)
    a = Tiny()
    b = Tiny()
    b.load_state_dict(a.state_dict())
    batch = {"x": torch.randn(4, 256)}
    training_step(a, batch, None, "cpu")
    training_step(b, batch, None, "cpu")
    same = compare_gradients(a, b)
    assert same.match and same.max_abs_diff == 0.0 == same.max_rel_error
    grads = gradients_of(b)
    bias = grads["b.bias"]
    grads["b.bias"] = bias + 1e-3
    diff = compare_gradients(a, grads)
    assert not diff.match and diff.mismatched == ["b.bias"]
    assert diff.max_abs_diff == pytest.approx(1e-3, rel=1e-3)
    assert diff.max_rel_error == pytest.approx(1e-3 * bias.numel() ** 0.5 / bias.norm().item(),
                                               rel=1e-3)  # |1e-3 * ones| / |bias|
    del grads["a.weight"]
    assert "a.weight" in compare_gradients(a, grads).mismatched


def test_unknown_precision_and_tracker_are_refused():
    with pytest.raises(ValueError, match="precision='fp8'"):
        training_step(Tiny(), {"x": torch.randn(2, 256)}, None, "cpu", "fp8")
    with pytest.raises(ValueError, match="tracker must be 'auto' or 'memtracker'"):
        PeakMemory("cpu", tracker="nvml")


def test_memory_monitor_measures_again_after_a_resume_and_keeps_the_record():
    from remat.callbacks import PeakMemoryMonitor

    before = PeakMemoryMonitor()
    before.peak_bytes, before.steps_done, before.epoch_peaks = 300, 2, [300]
    before.step_peaks = [200, 300]
    before.batches = [{"epoch": 0, "batch_idx": i, "global_step": i + 1, "optimizer_step": True}
                      for i in range(2)]
    after = PeakMemoryMonitor()
    after.load_state_dict(before.state_dict())
    assert after.is_tracking() and after.peak_bytes is None  # its own steps are measured
    assert after.epoch_peaks == [300]  # the per-epoch record goes on
    assert after.measured()["previous_runs"] == [{"peak_bytes": 300, "optimizer_steps": [1, 2]}]


class StorageCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of live tensor storages, counted the plainest way: what is held at the start
    (``tensors``), then every operator's outputs, each storage until it is freed (a
    ``weakref.finalize`` on it); no module or autograd hooks. ``peak`` after the block."""

    def __init__(self, tensors, outside=()):
        super().__init__()
        self.live, self.current = {}, 0
        for t in tensors:
            self._add(t)
        for t in outside:  # made before, not counted: a view of one allocates nothing
            self.live[t.untyped_storage()._cdata] = 0
        self.peak = self.current

    def _free(self, key):
        self.current -= self.live.pop(key)

    def _add(self, t):
        import weakref

        st = t.untyped_storage()
        if st._cdata not in self.live:
            self.live[st._cdata] = st.nbytes()
            self.current += st.nbytes()
            weakref.finalize(st, self._free, st._cdata)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self.current)
        return out


@pytest.mark.parametrize("strategy,adam", [("none", True), ("sqrtn", False), ("every_k", False)])
def test_peak_is_the_plain_storage_count_and_the_split_the_stock_memtracker(strategy, adam):
    """PeakMemory keeps only MemTracker's global peak (not every module's own, which costs
    O(operators x modules)) and puts no hooks on modules, whose multi-grad hooks keep some
    tensors alive longer than a plain run does. On a training step with checkpointed
    stages, backward and an optimizer step its peak is the plain storage count's, byte
    for byte, and a view of the batch (made before the tracker, as Lightning makes it)
    is not a new allocation: the stock tracker counts the int64 mask again."""
    import segmentation_models_pytorch as smp
    from torch.distributed._tools.mem_tracker import MemTracker

    from remat.strategies import build_strategy

    def step(track):
        torch.manual_seed(0)
        model = smp.Unet("resnet18", encoder_weights=None, classes=1,
                         decoder_channels=(16, 16, 8, 8, 8))
        build_strategy(strategy).apply(model, ["encoder.layer*", "decoder.blocks"])
        optimizer = (torch.optim.Adam(model.parameters()) if adam
                     else torch.optim.SGD(model.parameters(), lr=0.1))
        x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
        mask = torch.randint(0, 2, (2, 64, 64), generator=torch.Generator().manual_seed(2))
        model(x).square().mean().backward()
        optimizer.step()
        # the tracked second step holds Adam's state and the first step's gradients
        with track(model, optimizer, (x, mask)) as tracker:
            out = (model(x) - mask.unsqueeze(1).float()).square().mean()
            optimizer.zero_grad(set_to_none=True)  # Lightning's order: after the forward
            out.backward()
            optimizer.step()
            del out
        return tracker

    def stock(model, optimizer, batch):
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        return tracker

    def plain(model, optimizer, batch):
        held = [*model.parameters(), *model.buffers(),
                *(p.grad for p in model.parameters() if p.grad is not None),
                *(v for state in optimizer.state.values() for v in state.values()
                  if isinstance(v, torch.Tensor))]
        return StorageCount(held, outside=batch)

    ours = step(lambda model, optimizer, batch: PeakMemory("cpu", modules=[model],
                                                           optimizers=[optimizer]))
    assert ours.peak_bytes == step(plain).peak > 0
    theirs = step(stock)
    want = {str(getattr(k, "value", k)): int(v)
            for per_device in theirs.get_tracker_snapshot("peak").values()
            for k, v in per_device.items()}
    mask_bytes = 2 * 64 * 64 * 8
    assert ours.peak_bytes <= want["Total"] - mask_bytes
    if strategy == "none":  # the same but for the mask, counted again by the stock tracker
        assert ours.breakdown == {**want, "Activation": want["Activation"] - mask_bytes,
                                  "Total": want["Total"] - mask_bytes}
    assert ours.breakdown["Parameter"] == want["Parameter"]
    assert ours.breakdown["Gradient"] > 0  # filed as gradients without module hooks
    # Adam: the peak is in the optimizer step; plain SGD: in forward/backward
    assert ours.breakdown["Optstate" if adam else "Activation"] > 0


def test_a_planned_run_above_its_budget_warns_naming_both(caplog):
    from types import SimpleNamespace

    from remat.callbacks.memory import over_budget

    plan = SimpleNamespace(budget_bytes=226 * 2**20, predicted_allocator_peak_bytes=223 * 2**20,
                           compiled=True)
    module = SimpleNamespace(strategy=SimpleNamespace(plan=plan), compiled=True)
    with caplog.at_level("WARNING", logger="remat"):
        assert over_budget(module, 226 * 2**20) is None  # at the budget: fine
        assert caplog.text == ""
        note = over_budget(module, 238 * 2**20)
    assert "measured peak 238.0 MiB is above the budget 226.0 MiB" in caplog.text
    assert note in caplog.text  # summary.json's peak_memory_note
    assert "predicted 223.0 MiB" in caplog.text and "compile=false" in caplog.text
    # a plan made for the eager step (gpt_small 512 tokens, dropout 0.1: 333.0 MiB compiled
    # for a 300 MiB plan; planned with compile=true, 299.0): says to plan for the compiled one
    plan.compiled = False
    assert "plan with compile=true" in over_budget(module, 238 * 2**20)
    caplog.clear()
    with caplog.at_level("WARNING", logger="remat"):  # no plan: nothing to compare with
        assert over_budget(SimpleNamespace(strategy=SimpleNamespace()), 10**12) is None
    assert caplog.text == ""
