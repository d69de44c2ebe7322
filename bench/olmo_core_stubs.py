"""Stand-ins for OLMo-core's remote-storage imports on a machine without them.

`cached_path` (OLMo-core imports it at start-up for reading configs and checkpoints
from URLs) pulls in boto3, botocore and google-cloud-storage, which the H200 image
lacks and which would take most of the 64 MiB the device check may bring. The step
benchmark never reads a URL, so where `cached_path` does not import, install() puts
a module in its place whose every call says so. Real packages win: nothing is
replaced where the import works.
"""

import sys
import types


def _unavailable(*args, **kwargs):
  raise RuntimeError('cached_path is not installed here (bench/olmo_core_stubs.py stands in '
                     'for it): OLMo-core cannot read remote files in this process')


def install() -> bool:
  """Puts the stand-in in sys.modules if `cached_path` cannot be imported; True if it did."""
  try:
    import cached_path  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    from cached_path import schemes  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    return False
  except ImportError:
    pass
  root = types.ModuleType('cached_path')
  root.__path__ = []  # a package, so `cached_path.schemes` resolves to the module below
  root.cached_path = _unavailable
  schemes = types.ModuleType('cached_path.schemes')

  class SchemeClient:  # pylint: disable=too-few-public-methods
    scheme = ()
    recoverable_errors = ()  # OLMo-core's clients extend their base's tuple

    def __init__(self, *args, **kwargs):
      _unavailable()

  schemes.SchemeClient = SchemeClient
  schemes.S3Client = type('S3Client', (SchemeClient,), {})
  schemes.add_scheme_client = lambda client: None
  root.schemes = schemes
  sys.modules['cached_path'], sys.modules['cached_path.schemes'] = root, schemes
  return True
