"""Imports a file under scripts/ as a module (scripts/ is not a package)."""

import importlib.util
import os
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(name: str) -> types.ModuleType:
  """scripts/<name>.py as the module <name>; scripts define their flags only when run."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, 'scripts', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
