"""The transport under store/storage.py: tensorstore's key-value stores and what their errors mean.

store/storage.py is the seam every module calls; this module is what it stands on
and nothing else imports it (tests/test_seam.py). It turns a location into a
tensorstore kvstore (`gcs`, `s3`, `http`, or `file`), opened once with the
one Context that sets the retries, the stall abort and the concurrency bound,
and turns tensorstore's errors into this project's exit classes: a bucket that
does not exist, a bucket name the store rejects, or access denied is a
StorageConfigError (EXIT_USAGE: a rerun would repeat it); anything else after
the client's retries is a StorageError (EXIT_CRASH: scripts/launch.py
restarts it). While a request is retried, a line on stderr says so.

Retries: each store's client retries 5xx answers and dropped connections with
exponential backoff (tensorstore's `*_request_retries`: OLMO_STORAGE_RETRIES,
default 8, 0.5 s doubling to 32 s), and a transfer that stalls (under 1 byte/s
for OLMO_STORAGE_STALL_SECONDS, default 60) is aborted and retried, so a
stalled server cannot hang a save. Concurrency per store is bounded
(OLMO_STORAGE_CONCURRENCY, default 32). A request still waiting after
OLMO_STORAGE_NOTICE_SECONDS (default 10) is reported, then after twice as long.

Credentials come from each store's standard environment: Google application
default credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud, the metadata
server) and the AWS chain (AWS_ACCESS_KEY_ID, AWS_PROFILE, ...); without any,
the request is anonymous, which public buckets answer. Endpoints for other S3
services and emulators: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL; GCS
emulators: TENSORSTORE_GCS_HTTP_URL.
"""

import functools
import json
import os
import re
import time
from typing import Any

from absl import logging
import tensorstore as ts

import errors

OBJECT_SCHEMES = ('gs', 's3')  # writable object stores
READ_SCHEMES = ('http', 'https')  # read-only (token files)
MISSING = b'\x02'  # tensorstore's generation of a key that does not exist (NoValue)
URL_RE = re.compile(r'^([A-Za-z][A-Za-z0-9+.-]*):(//)?(.*)$')

def scheme(location: str) -> str:
  """'gs', 's3', 'http', 'https', or '' for a local path (a str or os.PathLike)."""
  m = URL_RE.match(os.fspath(location))
  if not m or (len(m.group(1)) == 1 and os.name == 'nt'):  # C:\ on Windows
    return ''
  return m.group(1).lower()


def describe(location: str) -> str:
  """What kind of storage, in words, for log lines."""
  return {'gs': 'Google Cloud Storage', 's3': 'S3', 'http': 'HTTP',
          'https': 'HTTPS'}.get(scheme(location), 'a local or shared filesystem')


# --- tensorstore key-value stores -------------------------------------------------------


def _env_int(name: str, default: int) -> int:
  try:
    return int(os.environ.get(name, default))
  except ValueError:
    raise errors.ConfigError(f'${name}={os.environ[name]!r} is not an integer.') from None


@functools.cache
def context() -> ts.Context:
  """The one tensorstore Context for remote stores: bounded concurrency, retries, stalls.

  Created on first use, before tensorstore starts its HTTP transport, which
  reads the curl low-speed settings from the environment then.
  """
  # tensorstore's own variables stand unless ours is set (a parent process that used
  # storage passes its defaults on to its children, which must not mask their setting).
  stall = str(_env_int('OLMO_STORAGE_STALL_SECONDS', 60))
  set_value = os.environ.__setitem__ if 'OLMO_STORAGE_STALL_SECONDS' in os.environ else (
      os.environ.setdefault)
  set_value('TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS', stall)
  set_value('TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES', '1')
  limit = _env_int('OLMO_STORAGE_CONCURRENCY', 32)
  retries = {'max_retries': _env_int('OLMO_STORAGE_RETRIES', 8), 'initial_delay': '0.5s',
             'max_delay': '32s'}
  spec = {}
  for driver in ('gcs', 's3', 'http'):
    spec[f'{driver}_request_retries'] = retries
    spec[f'{driver}_request_concurrency'] = {'limit': limit}
  return ts.Context(spec)


def bucket_and_key(location: str) -> tuple[str, str]:
  rest = URL_RE.match(location).group(3)
  bucket, _, key = rest.partition('/')
  return bucket, key


def kvstore_spec(location: str) -> dict[str, Any]:
  """A tensorstore kvstore spec whose path is `location` (a 'directory': end it with '/')."""
  s = scheme(location)
  if not s:
    return {'driver': 'file', 'path': os.path.abspath(location) + (
        '/' if location.endswith('/') else '')}
  if s in READ_SCHEMES:
    base, _, key = location.rpartition('/')
    return {'driver': 'http', 'base_url': base + '/', 'path': key}
  bucket, key = bucket_and_key(location)
  if s == 'gs':
    return {'driver': 'gcs', 'bucket': bucket, 'path': key}
  spec = {'driver': 's3', 'bucket': bucket, 'path': key}
  endpoint = os.environ.get('AWS_ENDPOINT_URL_S3') or os.environ.get('AWS_ENDPOINT_URL')
  if endpoint:
    spec['endpoint'] = endpoint
  region = os.environ.get('AWS_REGION') or os.environ.get('AWS_DEFAULT_REGION')
  if region:
    spec['aws_region'] = region
  if (os.environ.get('AWS_ACCESS_KEY_ID') and os.environ.get('AWS_SECRET_ACCESS_KEY')
      and not os.environ.get('AWS_PROFILE')):
    # Keys in the environment: only that provider. The default chain would also try
    # ~/.aws/config and ~/.aws/credentials and log an error line for each that is absent,
    # at every start, about files the keys make unnecessary.
    spec['aws_credentials'] = {'type': 'environment'}
  return spec


@functools.lru_cache(maxsize=64)
def _open(root: str, gcs_url: str | None) -> ts.KvStore:
  del gcs_url  # part of the cache key: tensorstore reads it when a gcs store opens
  spec = json.loads(root)
  ctx = context() if spec['driver'] != 'file' else None
  return ts.KvStore.open(spec, context=ctx).result()


def kvstore(location: str) -> tuple[ts.KvStore, str]:
  """(the opened store holding `location` at its root, the key of `location` in it). Stores
  are opened once and shared; callers may issue many reads at once as futures
  (tokens/remote_tokens.py reads a batch's byte ranges this way)."""
  spec = kvstore_spec(location)
  key = spec.pop('path')
  try:
    return _open(json.dumps(spec, sort_keys=True),
                 os.environ.get('TENSORSTORE_GCS_HTTP_URL')), key
  except ValueError as e:  # the driver refuses the spec: a bucket name the store rejects
    if spec['driver'] in ('gcs', 's3'):
      raise StorageConfigError(
          f'{describe(location)} rejects {location}: {" ".join(str(e).split())}. Correct the '
          'bucket name (GCS: 3-63 lowercase letters, digits, "-", "_" and "."; S3: 3-63 '
          'lowercase letters, digits, "-" and ".").', store_of(location)) from e
    raise


class StorageError(OSError):
  """The storage failed an operation after the client's retries: a rerun may succeed
  (EXIT_CRASH, which scripts/launch.py restarts). `failed_store` ('gs://BUCKET',
  's3://BUCKET', '' when unknown) is the store that failed: errors.one_line does not
  append the stack to a log kept there, which would wait out the same failure again."""

  def __init__(self, message: str, failed_store: str = ''):
    super().__init__(message)
    self.failed_store = failed_store


class StorageConfigError(errors.UserError, StorageError):
  """The store refused a request for a reason a rerun repeats: the bucket does not exist,
  its name is invalid, or the credentials may not use it (EXIT_USAGE, not restarted)."""


# tensorstore's status codes (its error's first word) by the fault they mean.
_DENIED = ('PERMISSION_DENIED', 'UNAUTHENTICATED')
_DENIED_HTTP = ("http_response_code='401'", "http_response_code='403'")


def retry_budget_seconds() -> float:
  """The longest the client's backoff between attempts of one request adds up to
  (OLMO_STORAGE_RETRIES, 0.5 s doubling to 32 s: 95.5 s for the default 8 retries)."""
  return sum(min(32.0, 0.5 * 2 ** k) for k in range(_env_int('OLMO_STORAGE_RETRIES', 8)))


def credentials_hint(location: str) -> str:
  """Where each store takes its credentials from, for an access-denied message."""
  s = scheme(location)
  if s == 'gs':
    return ('give Google credentials that may use the bucket (GOOGLE_APPLICATION_CREDENTIALS='
            'key.json, `gcloud auth application-default login`, or a VM service account)')
  if s == 's3':
    return ('give AWS credentials that may use the bucket (AWS_ACCESS_KEY_ID and '
            'AWS_SECRET_ACCESS_KEY, or AWS_PROFILE), and AWS_REGION / AWS_ENDPOINT_URL for a '
            'non-AWS store')
  return 'check the URL, or that the server lets this machine read it'


def endpoint(location: str) -> str:
  """The server a URL's requests go to, and the variable that sets it, in words."""
  s = scheme(location)
  if s == 'gs':
    url = os.environ.get('TENSORSTORE_GCS_HTTP_URL')
    return (f'{url} ($TENSORSTORE_GCS_HTTP_URL)' if url else
            'https://storage.googleapis.com (set $TENSORSTORE_GCS_HTTP_URL for an emulator)')
  if s == 's3':
    for name in ('AWS_ENDPOINT_URL_S3', 'AWS_ENDPOINT_URL'):
      if os.environ.get(name):
        return f'{os.environ[name]} (${name})'
    return 'AWS S3 (set $AWS_ENDPOINT_URL for another S3 service)'
  return location


def store_of(location: str) -> str:
  """'gs://BUCKET' / 's3://BUCKET' of a bucket URL, else ''."""
  if scheme(location) not in OBJECT_SCHEMES:
    return ''
  return f'{scheme(location)}://{bucket_and_key(location)[0]}'


def failed(op: str, location: str, e: Exception) -> StorageError:
  """The error for `op` on `location` failing with tensorstore's `e`, by its class: a bucket
  that does not exist, a bucket name the store rejects, or access denied -> a
  StorageConfigError (EXIT_USAGE); anything else (unreachable, 5xx after the retries) a
  StorageError (EXIT_CRASH: restarted)."""
  # The status and the store's message; a server's HTML or XML body adds only noise.
  text = re.sub(r" ?\[http_response_body='.*?'\](?= \[|$)", '', ' '.join(str(e).split()))
  short = text if len(text) <= 300 else text[:300] + '...'
  code = text.split(':', 1)[0]
  where, store = describe(location), store_of(location)
  bucket = bucket_and_key(location)[0] if store else ''
  if store and (code == 'NOT_FOUND' or 'NoSuchBucket' in text):
    # A key that does not exist is an answer, not an error: only the bucket is left.
    return StorageConfigError(
        f'the bucket {bucket!r} does not exist on {where} ({op} {location} answered '
        f'{short}). Create it, or correct the bucket name in the URL; requests went to '
        f'{endpoint(location)}.', store)
  if code in _DENIED or any(h in text for h in _DENIED_HTTP):
    return StorageConfigError(
        f'{where} denied {op} {location} ({short}); {credentials_hint(location)}.', store)
  if store and code == 'INVALID_ARGUMENT' and 'bucket' in text.lower():
    return StorageConfigError(
        f'{where} rejects the bucket name {bucket!r} ({op} {location}: {short}); correct '
        'the bucket name in the URL.', store)
  return StorageError(
      f'{op} {location} failed on {where} after the client\'s retries ({short}); requests '
      f'went to {endpoint(location)}. A rerun may succeed once the store answers.', store)


def notice_seconds() -> int:
  """How long a request waits before a line says it is being retried
  (OLMO_STORAGE_NOTICE_SECONDS, default 10); each next line after twice as long."""
  seconds = _env_int('OLMO_STORAGE_NOTICE_SECONDS', 10)
  if seconds < 1:
    raise errors.ConfigError(f'$OLMO_STORAGE_NOTICE_SECONDS={seconds} must be at least 1 '
                             '(seconds before a retried request is reported).')
  return seconds


def result(future: Any, op: str, location: str) -> Any:
  """`future.result()`, saying on stderr what is waited for while the client retries (a
  store that does not answer is retried for up to retry_budget_seconds() per request)."""
  start, notice = time.monotonic(), notice_seconds()
  while True:
    try:
      return future.result(timeout=max(0.0, start + notice - time.monotonic()))
    except TimeoutError:
      if future.done():  # it ended as the wait did, or with its own TimeoutError: its outcome
        return future.result()
      logging.warning('Still %s %s on %s after %.0f s: the client retries a failing request '
                      'for up to %.0f s (OLMO_STORAGE_RETRIES), then this run stops; requests '
                      'go to %s.', op, location, describe(location), time.monotonic() - start,
                      retry_budget_seconds(), endpoint(location))
      notice *= 2
