"""The private surface: every access this package makes to DeepSpeed, Lightning, torch, transformers and Accelerate
internals, in one package of one file per library (``zero3``, its step's patches ``zero3_step``, ``lightning``,
``huggingface``; ``_access`` reads a name).

Nothing else in the package reads a private attribute of another library or patches one of its methods. Every name is
read directly, without a default that would hide a rename (a renamed attribute raises :class:`UpstreamChanged`
naming it, instead of reporting 0 bytes or never logging a skipped step). ``tests/upstream_names.py`` lists each name
(``PRIVATE_NAMES``: what it is expected to be and why the package needs it) and the upstream code the package copies
or replaces (``COPIED_UPSTREAM``: a fingerprint of each tested version's source); ``tests/test_upstream.py`` checks
both against the installed versions, so an upgrade that changes one fails there, naming it.

DeepSpeed bug worked around here (0.18.3 - 0.19.8 at least): ZeRO-3 master aliasing
    ``DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions`` reuses the parameter partition as the master partition
    only when ``partition.device == self.device``. ``self.device`` is a string (``'cpu'``, ``'cuda:0'``) and a
    ``torch.device`` never equals a string, so with ``bf16_master_weights_and_grads`` it always allocates a second
    bf16 copy of every partition (10 instead of 8 bytes/param). :func:`alias_bf16_master_partitions` presents
    ``self.device`` as a ``torch.device`` while the partitions are created. Once aliased, DeepSpeed's copy back into
    the parameter partition after each step is a copy of a tensor onto itself, which torch skips.
    ``tests/test_upstream.py::test_master_aliasing_bug_and_fix`` shows the bug and the fix.
"""

from lightning_pure_bf16._internals._access import *  # noqa: F403
from lightning_pure_bf16._internals.huggingface import *  # noqa: F403
from lightning_pure_bf16._internals.lightning import *  # noqa: F403
from lightning_pure_bf16._internals.zero3 import *  # noqa: F403
from lightning_pure_bf16._internals.zero3 import _GRAD_VIEWS, _without_gradient_buffers  # noqa: F401
from lightning_pure_bf16._internals.zero3_step import *  # noqa: F403
