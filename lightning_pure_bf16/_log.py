"""The package's messages: the logger ``lightning_pure_bf16``, and its set-up lines said once per job, by rank 0.

As Lightning's and DeepSpeed's loggers do, the package logger prints INFO and above to the console (stderr, as
``INFO: message``), so a fit's set-up and end-of-fit lines show in every front end, with or without Lightning loaded.
``logging.getLogger("lightning_pure_bf16").setLevel(logging.WARNING)`` keeps only warnings. A message's rank is
torch.distributed's once it is set up, before that the launcher's environment (Lightning's order of variables).
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

log = logging.getLogger("lightning_pure_bf16")
log.setLevel(logging.INFO)
console = logging.StreamHandler()
console.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
log.addHandler(console)

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def global_rank() -> int:
    """This process's rank in the job: torch.distributed's, else the launcher's environment, else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    for name in _RANK_VARIABLES:
        if name in os.environ:
            return int(os.environ[name])
    return 0


def rank_zero_info(message: str) -> None:
    """Log ``message`` at INFO on rank 0 only."""
    if global_rank() == 0:
        log.info(message)


def rank_zero_warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn on rank 0 only, attributed to the caller's caller (the user's code that called into the package)."""
    if global_rank() == 0:
        warnings.warn(message, category, stacklevel=3)


__all__ = ["console", "global_rank", "log", "rank_zero_info", "rank_zero_warn"]
