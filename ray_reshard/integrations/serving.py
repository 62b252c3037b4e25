"""Moved to `ray_reshard.engines.vllm.serving`; this path warns and is kept for one release."""
import warnings

from ..engines.vllm.serving import *  # noqa: F401,F403
from ..engines.vllm.serving import __all__  # noqa: F401

warnings.warn("ray_reshard.integrations.serving moved to ray_reshard.engines.vllm.serving",
              DeprecationWarning, stacklevel=2)
