"""The engine's errors: each names what was wrong so a user can act without reading logs."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidParameterError(EngineError, ValueError):
    """A parameter is outside what the runtime survives; raised before any native call."""

    def __init__(self, parameter: str, message: str) -> None:
        super().__init__(f"invalid {parameter}: {message}")
        self.parameter = parameter


class ModelTooLargeError(EngineError):
    """The memory check refused a model: the message names the estimate and every figure."""

    def __init__(self, message: str, estimate: int, figures: dict[str, int | None]) -> None:
        super().__init__(message)
        self.estimate = estimate
        self.figures = figures


class ModelLoadError(EngineError):
    """A model could not be loaded; quotes our header check or the runtime's error records."""

    def __init__(self, message: str, role: str | None = None, records: list[str] | None = None):
        super().__init__(message)
        self.role = role
        self.records = records or []


class GenerationError(EngineError):
    """A generation failed; quotes the runtime's error records."""

    def __init__(self, message: str, records: list[str] | None = None) -> None:
        super().__init__(message)
        self.records = records or []


class EnginePoisonedError(EngineError):
    """The backend is in an error state (or the engine was disposed): reload the model."""
