"""sdfarm.native: one stable-diffusion.cpp engine, its memory rules, device figures and logs.

Importing this package loads no native code: the runtime is loaded on the first `Engine.load`
(or device probe), so a process that forks can import it safely.
"""

from sdfarm.native.errors import (
    EngineError,
    EnginePoisonedError,
    GenerationError,
    InvalidParameterError,
    ModelLoadError,
    ModelTooLargeError,
)
from sdfarm.native.params import GenerationParams

__all__ = [
    "Engine",
    "EngineError",
    "EnginePoisonedError",
    "GenerationError",
    "GenerationParams",
    "InvalidParameterError",
    "LogConfig",
    "ModelLoadError",
    "ModelTooLargeError",
]


def __getattr__(name: str):
    # Engine pulls in PIL and the model readers; keep `import sdfarm.native` light.
    if name in ("Engine", "LogConfig"):
        from sdfarm.native import engine

        return getattr(engine, name)
    raise AttributeError(name)
