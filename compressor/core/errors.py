"""Errors and warnings raised by compressor. They name what is wrong and what is allowed."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config_list, config file or argument is invalid.

    Raised before any model is touched, so the user's model is left exactly as it was.
    """


class ModelError(TypeError):
    """The model given to a compressor is not one the backend can instrument."""


class BackendNotAvailable(ImportError):
    """The framework a backend needs (torch / tensorflow) is not installed."""


class ConfigWarning(UserWarning):
    """A config entry is legal but probably not what the user meant (e.g. names matching no layer)."""


class CompressedFileError(ValueError):
    """A compressed model file (``export_model(..., compressed_path=...)``, ``compressor pack``) is missing,
    truncated, corrupted or not one; or does not fit the model it is loaded into. Raised before any
    weight is written, so the model is left exactly as it was."""
