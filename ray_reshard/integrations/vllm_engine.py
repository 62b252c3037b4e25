"""Moved to `ray_reshard.engines.vllm.launch`; this path warns and is kept for one release."""
import warnings

from ..engines.vllm.launch import *  # noqa: F401,F403
from ..engines.vllm.launch import __all__  # noqa: F401

warnings.warn("ray_reshard.integrations.vllm_engine moved to ray_reshard.engines.vllm.launch",
              DeprecationWarning, stacklevel=2)
