"""How the fast path is swapped into a built module, and out again.

`become(module, FastPath)` makes the module an instance of a subclass of its own class with the
`FastPath` mixin first in the method order, named "Native" + the class name (NativeLinear,
NativeRMSNorm, NativeCausalLM, NativeEagleDraft: `print(model)` shows what was
swapped). The module keeps its identity, parameters, buffers, state-dict names and hooks; only
the methods the mixin defines change, and they call the plain class's (`super()`) wherever the
fast path does not apply. This is how torch.nn.utils.parametrize changes a module's class.
`restore` makes it plain again and drops the mixin's `state` attributes.
"""

from __future__ import annotations

from typing import Any

from torch import nn

_CLASSES: dict[tuple[type, type], type] = {}  # (mixin, plain class) -> the swapped-in class


def become(module: nn.Module, mixin: type, **state: Any) -> None:
    """Swaps `mixin` into `module` (replacing any earlier swap) and sets its `state`."""
    restore(module)
    plain = type(module)
    cls = _CLASSES.get((mixin, plain))
    if cls is None:
        attrs = {"plain_class": plain, "__module__": mixin.__module__}
        cls = _CLASSES[(mixin, plain)] = type(f"Native{plain.__name__}", (mixin, plain), attrs)
    module.__class__ = cls
    for name, value in state.items():
        setattr(module, name, value)


def restore(module: nn.Module) -> None:
    """Makes a swapped module plain again (a plain one is left as it is)."""
    plain = type(module).__dict__.get("plain_class")
    if plain is None:
        return
    for name in type(module).state:
        module.__dict__.pop(name, None)
    module.__class__ = plain
