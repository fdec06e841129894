"""A second stop signal while :class:`remat.callbacks.LastCheckpoint` waits for the step to
end is handed on: to the SIGTERM handler installed before it (Lightning's, in a run), or,
with none, the process's default action."""

from __future__ import annotations

import os
import signal

import remat.callbacks.checkpoint as checkpoint
from remat.callbacks.checkpoint import LastCheckpoint


def test_the_second_sigterm_reaches_the_handler_installed_before(tmp_path):
    seen: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        callback = LastCheckpoint(tmp_path)
        callback.on_train_start(None, None)
        os.kill(os.getpid(), signal.SIGTERM)
        assert callback.received_signal == "SIGTERM" and seen == []  # held for the step
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGTERM)  # the earlier handler is back in place
        assert seen == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


def test_the_second_sigterm_without_an_earlier_handler_terminates(tmp_path, monkeypatch):
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sent: list[tuple[int, int]] = []
    try:
        callback = LastCheckpoint(tmp_path)
        callback.on_train_start(None, None)
        monkeypatch.setattr(checkpoint.os, "kill", lambda pid, signum: sent.append((pid,
                                                                                   signum)))
        callback._on_signal(signal.SIGTERM, None)
        assert sent == [] and callback.received_signal == "SIGTERM"
        callback._on_signal(signal.SIGTERM, None)
        # the default action again, delivered now: the process ends at once
        assert sent == [(os.getpid(), signal.SIGTERM)]
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        monkeypatch.undo()
        signal.signal(signal.SIGTERM, old)
