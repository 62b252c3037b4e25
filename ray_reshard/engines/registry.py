"""Engines by name: what a layout class is called on the command line and which side it
describes. An engine registers itself once; nothing else lists engines."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["Engine", "engine", "engines", "register_engine"]


@dataclass(frozen=True)
class Engine:
    """`name`: the command-line spelling (``vllm``); `layout`: the layout dataclass
    (`VLLM`), whose fields are the ``key=value`` pairs; `role`: "train" or "infer";
    `example`: a layout written out; `complete`: fills fields left out from those given
    (e.g. Megatron's dp)."""

    name: str
    layout: type
    role: str
    example: str
    complete: Optional[Callable[[dict], dict]] = None

    def __post_init__(self):
        if self.role not in ("train", "infer"):
            raise ValueError(f"engine {self.name!r}: role must be 'train' or 'infer', got "
                             f"{self.role!r}")
        if not dataclasses.is_dataclass(self.layout):
            raise TypeError(f"engine {self.name!r}: layout must be a dataclass, got "
                            f"{self.layout!r}")


_ENGINES: dict[str, Engine] = {}


def register_engine(e: Engine) -> Engine:
    """Make `e` known by its name (again: replaced)."""
    _ENGINES[e.name] = e
    return e


def engine(name: str) -> Engine:
    try:
        return _ENGINES[name]
    except KeyError:
        raise KeyError(f"no engine {name!r}; known: {', '.join(sorted(_ENGINES))}") from None


def engines(role: Optional[str] = None) -> list[Engine]:
    """The registered engines (of one role), in registration order."""
    return [e for e in _ENGINES.values() if role is None or e.role == role]
