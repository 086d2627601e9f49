"""Filters for the third-party warnings a pure-bf16 fit triggers on every step, each matched by message and origin.

DeepSpeed 0.19 calls ``torch.distributed.all_gather_into_tensor``/``reduce_scatter_tensor``, deprecated since torch
2.13, on every gather and reduce-scatter, and exits ``warnings.catch_warnings`` blocks often enough that Python shows
the warning again each time: over a thousand lines in the main job. Lightning's pytree helper builds a deprecated
``LeafSpec`` at every step, and DeepSpeed logs that ZeRO runs an "untested optimizer" (this package's, on purpose).
Only these exact messages from these exact places are dropped; every other warning still shows, including the same
messages from anywhere else. If an upgrade changes a message or its origin, the warning shows again.
"""

from __future__ import annotations

import logging
import threading
import warnings

# (message regex, category, module regex) for warnings.filterwarnings.
KNOWN_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    (
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        FutureWarning,
        r"torch\.distributed\.c10d_logger",
    ),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\.pytorch\.utilities\._pytree"),
)
# (logger name, message start) for records of third-party loggers.
KNOWN_LOG_RECORDS: tuple[tuple[str, str], ...] = (("DeepSpeed", "**** You are using ZeRO with an untested optimizer"),)

_installed = False
_lock = threading.Lock()


class _DropRecords(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def silence_known_warnings() -> None:
    """Install the filters once per process (idempotent; later calls do nothing)."""
    global _installed
    with _lock:
        if _installed:
            return
        for message, category, module in KNOWN_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category, module=module)
        by_logger: dict[str, tuple[str, ...]] = {}
        for name, start in KNOWN_LOG_RECORDS:
            by_logger[name] = (*by_logger.get(name, ()), start)
        for name, starts in by_logger.items():
            logging.getLogger(name).addFilter(_DropRecords(starts))
        _installed = True


__all__ = ["KNOWN_LOG_RECORDS", "KNOWN_WARNINGS", "silence_known_warnings"]
