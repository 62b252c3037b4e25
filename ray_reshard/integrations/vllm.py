"""Moved to `ray_reshard.engines.vllm.backend`; this path warns and is kept for one release."""
import warnings

from ..engines.vllm.backend import *  # noqa: F401,F403
from ..engines.vllm.backend import __all__  # noqa: F401

warnings.warn("ray_reshard.integrations.vllm moved to ray_reshard.engines.vllm.backend",
              DeprecationWarning, stacklevel=2)
