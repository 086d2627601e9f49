"""How the private surface reads another library: by name, without a default that would hide a rename."""

from __future__ import annotations

import importlib
from typing import Any


class UpstreamChanged(AttributeError):
    """A private name of DeepSpeed, Lightning or torch the package relies on is missing from the installed version."""


# ----------------------------------------------------------------------------------------------------------- resolution
def resolve(owner: str) -> Any:
    """The object named ``"module:Qualname"`` (or ``"module"``); a nested function is not resolvable this way."""
    module_name, _, qualname = owner.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def _read(obj: Any, name: str, why: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise UpstreamChanged(
            f"`{type(obj).__module__}.{type(obj).__qualname__}` has no attribute `{name}` ({why}). The installed"
            " DeepSpeed/Lightning is not a version lightning_pure_bf16 supports: see the bounds in its pyproject.toml."
        ) from None


__all__ = ["UpstreamChanged", "_read", "resolve"]
