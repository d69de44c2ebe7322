"""Test-only packages (torch, transformers, lm_eval), imported only where a mode needs them.

They are the references our numbers are checked against, not runtime
dependencies, so `eval.py --suite=downstream,heldout,paloma` runs without them.
"""

import importlib
import types

import errors


class MissingPackageError(errors.UserError, ImportError):
  """A test-only package a mode needs is not installed (EXIT_USAGE: one line, the fix)."""


def require(module: str) -> types.ModuleType:
  """`module`, imported; if it is missing, an ImportError that names it and the fix."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise MissingPackageError(f'{module} is not installed; it is a test-only reference package, '
                              "installed with `pip install '.[test]'`.") from e
