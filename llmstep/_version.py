"""The package's version, in a module of its own so that any layer can read it without importing llmstep's
public API (llmstep/__init__.py re-exports it). Keep it equal to pyproject.toml's `version`."""

__version__ = "0.1.0"
