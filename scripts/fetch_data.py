"""Downloads the token files of a mix and writes a local mix file for train.py.

A mix is a file of `label,path` lines (OLMo-core ships Ai2's under
olmo_core/data/mixes/: stage 1 `OLMo-mix-0925-official`, stage-2 midtraining
`OLMo-midtraining-mix-0925-ingredient1-100B`, ..., stage-3 long context
`OLMo-longmino-mix-0925`); each path, with `{TOKENIZER}` substituted, is
joined to --base_url. Files land under --output_dir with the same relative
paths, through store/download.py (parallel, resumed, retried, verified); a local
mix `label,absolute path,bytes` is written only once every file is in place:

  python scripts/fetch_data.py --mix=OLMo-mix-0925-official --output_dir=/data/olmo3 --list
  python scripts/fetch_data.py --mix=OLMo-mix-0925-official --output_dir=/data/olmo3
  python train.py --config=configs/olmo3_7b.py --workdir=W \
      --config.data.mix_file=/data/olmo3/OLMo-mix-0925-official.txt

--list prints files, bytes and tokens per source (from HEAD requests) and
downloads nothing. --remote_mix=MIX.txt downloads nothing either: it writes a
mix of the URLs and their sizes, which train.py reads remotely, by byte range
(docs/data.md#remote-data); the sizes let it check each file with one
request. Rerunning a fetch resumes partial files and skips complete ones.

A host that cannot be reached stops the listing or the fetch at the first
file that shows it, with one line: a name that does not resolve (no network,
or a wrong --base_url) at once, with exit code 2; a host that refuses every
connection after that file's retries. The other files would only fail the
same way.

--checksums takes a sha256sum-style file; its paths may be written as
`path`, `./path`, `/path` or `*path` (binary mode). With it, every file to
fetch must have an entry: a file it does not list is an error, not a file
left unverified.
"""

import collections
import concurrent.futures
import os
import posixpath
import sys
import threading

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import errors  # noqa: E402
from store import download  # noqa: E402  (the repository root must be on the path first)
from store import storage  # noqa: E402
from tokens import token_files  # noqa: E402  (not data.py: a listing needs no JAX)

FLAGS = flags.FLAGS  # defined by define_flags() when run as a script

# OLMo-core DataMix.build: the Olmo 3 mixes were tokenized under the name
# allenai/dolma3-tokenizer (the same tokenizer as dolma2); the perplexity sets
# use short names. Any other mix uses the tokenizer's own id.
_OLMO3_MIXES = ('OLMo-mix-0625-official', 'OLMo-mix-0925-official',
                'OLMo-midtraining-mix-0625-100B', 'OLMo-midtraining-mix-0925-ingredient1-100B',
                'OLMo-midtraining-mix-0925-ingredient2-100B', 'OLMo-longmino-mix-0625',
                'OLMo-longmino-mix-0925')
_SHORT_ID_MIXES = ('v3-small-ppl-validation', 'c4-ppl-validation', 'code-fresh-ppl-validation')
DOLMA2_ID = 'allenai/dolma2-tokenizer'


def mixes_dir() -> str:
  """olmo_core/data/mixes in the installed ai2-olmo-core wheel."""
  try:
    import olmo_core  # pylint: disable=g-import-not-at-top  # test extra; only mix names need it
  except ImportError as e:
    raise FileNotFoundError('mix names are looked up in the ai2-olmo-core wheel, which is not '
                            "installed: pip install 'ai2-olmo-core==3.0.0', or pass --mix as "
                            'a path to a mix file.') from e
  return os.path.join(os.path.dirname(olmo_core.__file__), 'data', 'mixes')


def mix_file(mix: str) -> str:
  """The mix file for a name (olmo_core/data/mixes/NAME.txt) or a path."""
  if os.path.isfile(mix):
    return mix
  if os.sep in mix:
    raise FileNotFoundError(f'--mix {mix!r}: no such file.')
  directory = mixes_dir()
  path = os.path.join(directory, mix.removesuffix('.txt') + '.txt')
  if not os.path.isfile(path):
    names = sorted(n[:-4] for n in os.listdir(directory) if n.endswith('.txt'))
    raise FileNotFoundError(f'--mix {mix!r} is neither a file nor a mix OLMo-core ships; its '
                            f'mixes are: {", ".join(names)}.')
  return path


def tokenizer_id(mix: str) -> str:
  """OLMo-core's {TOKENIZER} substitution for the dolma2 tokenizer and this mix."""
  name = os.path.basename(mix).removesuffix('.txt')
  if name in _OLMO3_MIXES:
    return 'allenai/dolma3-tokenizer'
  if name in _SHORT_ID_MIXES:
    return 'dolma2-tokenizer'
  return DOLMA2_ID


def checksum_key(path: str) -> str:
  """A path as read_checksums keys it: `./a/b`, `/a/b` and `a//b` are all `a/b`."""
  return posixpath.normpath(path).lstrip('/')


def read_checksums(path: str) -> dict[str, str]:
  """{relative path: sha256 hex} from `HEX  path` lines (sha256sum's format).

  `HEX *path` (sha256sum -b) and the `./path` that `find . | xargs sha256sum`
  prints name the same file as `path`.
  """
  sums = {}
  with open(path) as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      digest, _, name = line.strip().partition(' ')
      name = name.strip().removeprefix('*')
      if len(digest) != 64 or not name:
        raise ValueError(f'{path}:{line_no}: expected `SHA256HEX  relative/path`, got {line!r}.')
      sums[checksum_key(name)] = digest.lower()
  return sums


def expected_sums(paths: list[str], sums: dict[str, str], source: str) -> list[str]:
  """The sha256 of each path; a path `sums` (read from `source`) does not list is an error."""
  missing = [p for p in paths if checksum_key(p) not in sums]
  if missing:
    more = f' (and {len(missing) - 1} more files)' if len(missing) > 1 else ''
    raise ValueError(f'{missing[0]}{more}: no entry in --checksums {source}; add it, or fetch '
                     'without --checksums.')
  return [sums[checksum_key(p)] for p in paths]


def entries(mix: str, tok_id: str = '', labels: tuple[str, ...] = (),
            max_files: int = 0) -> list[tuple[str, str]]:
  """(label, relative path) per file of the mix, in mix order, filtered."""
  rel_paths, mix_labels, _ = token_files.read_mix(mix_file(mix),
                                                  tokenizer_id=tok_id or tokenizer_id(mix))
  unknown = set(labels) - set(mix_labels)
  if unknown:
    raise ValueError(f'--labels {sorted(unknown)} are not in the mix; its labels are '
                     f'{sorted(set(mix_labels))}.')
  out = [(l, p) for l, p in zip(mix_labels, rel_paths) if not labels or l in labels]
  return out[:max_files] if max_files else out


def url_of(base_url: str, rel_path: str) -> str:
  return storage.resolve(base_url, rel_path)  # OLMo-core DataMix.build: f'{base_dir}{path}'


def sizes(urls: list[str], workers: int = 8,
          timeout: float = 60.0) -> list[int | None | download.DownloadError]:
  """Remote size of each URL (HEAD), None if unknown, or the DownloadError (404, ...).

  Raises download.HostUnreachable at the first URL whose host cannot be
  reached, and asks about no further URL: each would fail the same way.
  """
  stop = threading.Event()

  def one(url):
    if stop.is_set():
      return None
    try:
      return download.remote_size(url, timeout=timeout)
    except download.HostUnreachable:
      stop.set()
      raise
    except download.DownloadError as e:
      return e
  pool = concurrent.futures.ThreadPoolExecutor(max(1, workers))
  try:
    futures = [pool.submit(one, url) for url in urls]
    for future in concurrent.futures.as_completed(futures):
      future.result()  # the first HostUnreachable, as soon as it happens
    return [future.result() for future in futures]
  finally:
    pool.shutdown(wait=True, cancel_futures=True)


def summarize(files: list[tuple[str, str]], found: list, seq_len: int) -> str:
  """The --list table: files, bytes, tokens and instances per source, then the total."""
  rows: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0, 0])
  for (label, _), size in zip(files, found):
    row = rows[label]
    if isinstance(size, int):
      row[0], row[1], row[2], row[3] = row[0] + 1, row[1] + size, row[2] + size // 4, \
          row[3] + size // 4 // seq_len
    else:
      row[4] += 1  # missing or size unknown
  total = [sum(r[i] for r in rows.values()) for i in range(5)]
  width = max([len(l) for l in rows] + [6])
  lines = [f'{"source":<{width}} {"files":>7} {"bytes":>19} {"tokens":>17} '
           f'{"instances@" + str(seq_len):>15} {"unavailable":>11}']
  for label, r in [*rows.items(), ('TOTAL', total)]:
    lines.append(f'{label:<{width}} {r[0]:>7,} {r[1]:>19,} {r[2]:>17,} {r[3]:>15,} {r[4]:>11,}')
  return '\n'.join(lines)


def write_local_mix(path: str, rows: list[tuple[str, str, int]], header: str) -> None:
  """Writes `label,path,bytes` lines atomically (token_files.read_mix reads them)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    f.write(f'# {header}\n')
    for label, file, size in rows:
      if ',' in label or ',' in file:
        raise ValueError(f'{label},{file}: a comma in a label or path breaks the mix format.')
      f.write(f'{label},{file},{size}\n' if size is not None else f'{label},{file}\n')
  os.replace(tmp, path)


def write_remote_mix(path: str, files: list[tuple[str, str]], urls: list[str], found: list,
                     missing: list) -> int:
  """--remote_mix: a mix of the URLs themselves, with the sizes the server stated, for
  train.py to read remotely (docs/data.md#remote-data); nothing is downloaded."""
  if missing and not FLAGS.skip_missing:
    shown = '\n  '.join(str(e) for _, e in missing[:10])
    sys.exit(f'error: {len(missing)} of {len(files)} files are unavailable:\n  {shown}\n'
             'Fix --base_url (or the mix), or pass --skip_missing to leave them out.')
  rows = [(l, u, s) for (l, _), u, s in zip(files, urls, found)
          if not isinstance(s, download.DownloadError)]
  write_local_mix(path, rows, f'{len(rows)} files of {FLAGS.mix} at {FLAGS.base_url}, read '
                  'remotely; written by scripts/fetch_data.py --remote_mix')
  print(f'remote mix: {path}  (--config.data.mix_file={path}; {len(rows)} files)')
  return 0


def canonical_flags() -> None:
  """The location flags in storage.canonical's one form, or one line (exit 2) before any work.
  --base_url is read (a path, gs://, s3://, http(s)://); the files, the local mix and the
  checksums are local (store/download.py writes local files; copy them up afterwards)."""
  if FLAGS.base_url:
    FLAGS.base_url = storage.canonical(FLAGS.base_url, '--base_url', writes=False)
  for name in ('output_dir', 'local_mix', 'remote_mix', 'checksums'):
    if FLAGS[name].value:
      FLAGS[name].value = storage.canonical(FLAGS[name].value, f'--{name}', local_only=True)
  if FLAGS.mix:  # a mix's name or a local file; no URL
    storage.canonical(FLAGS.mix, '--mix', local_only=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  with errors.one_line():
    canonical_flags()
  if not FLAGS.mix:
    raise app.UsageError('--mix is required (a name from olmo_core/data/mixes/ or a file).')
  if not FLAGS.list and not FLAGS.output_dir and not FLAGS.remote_mix:
    raise app.UsageError('--output_dir is required to download (or pass --list or --remote_mix).')
  try:
    files = entries(FLAGS.mix, FLAGS.tokenizer_id, tuple(FLAGS.labels), FLAGS.max_files)
    urls = [url_of(FLAGS.base_url, p) for _, p in files]
    found = sizes(urls, FLAGS.workers, FLAGS.timeout)
    missing = [(u, s) for u, s in zip(urls, found) if isinstance(s, download.DownloadError)]
    if FLAGS.list:
      print(summarize(files, found, FLAGS.seq_len))
      for url, err in missing:
        print(f'unavailable: {url}: {err}', file=sys.stderr)
      return 1 if missing else 0
    if FLAGS.remote_mix:
      return write_remote_mix(FLAGS.remote_mix, files, urls, found, missing)
    if missing and not FLAGS.skip_missing:
      shown = '\n  '.join(str(e) for _, e in missing[:10])
      sys.exit(f'error: {len(missing)} of {len(files)} files are unavailable:\n  {shown}\n'
               'Fix --base_url (or the mix), or pass --skip_missing to leave them out (the '
               "data order then differs from Ai2's). Nothing was downloaded.")
    local = FLAGS.local_mix or os.path.join(FLAGS.output_dir,
                                            os.path.basename(mix_file(FLAGS.mix)))
    if os.path.abspath(local) == os.path.abspath(mix_file(FLAGS.mix)):
      raise ValueError(f'the local mix {local} would overwrite --mix; pass --local_mix=OTHER.txt.')
    keep = [(l, p, u, s) for (l, p), u, s in zip(files, urls, found)
            if not isinstance(s, download.DownloadError)]
    digests = (expected_sums([p for _, p, _, _ in keep], read_checksums(FLAGS.checksums),
                             FLAGS.checksums) if FLAGS.checksums else [None] * len(keep))
    items = [download.Item(u, os.path.join(FLAGS.output_dir, p), size=s, sha256=d)
             for (_, p, u, s), d in zip(keep, digests)]
    report = download.fetch(items, workers=FLAGS.workers, retries=FLAGS.retries,
                            timeout=FLAGS.timeout)
  except download.HostUnreachable as e:
    print(f'error: {e} (--base_url={FLAGS.base_url})', file=sys.stderr)
    return errors.EXIT_CRASH if e.resolved else errors.EXIT_USAGE
  except (download.DownloadError, FileNotFoundError, ValueError) as e:
    sys.exit(f'error: {e}')
  rows = [(l, os.path.abspath(i.dest), os.path.getsize(i.dest)) for (l, *_), i in zip(keep, items)]
  write_local_mix(local, rows, f'{len(rows)} files from {FLAGS.mix} at {FLAGS.base_url}; '
                  'written by scripts/fetch_data.py')
  print(f'{report.downloaded} downloaded, {report.skipped} already complete; '
        f'{report.bytes:,} bytes transferred, {report.total_bytes:,} bytes in {len(rows)} files')
  if missing:
    print(f'WARNING: {len(missing)} unavailable files were left out; the data order differs '
          "from Ai2's.", file=sys.stderr)
  print(f'local mix: {local}  (--config.data.mix_file={local})')
  return 0


def define_flags() -> None:
  """The command line; defined only when run as a script, so importing it defines no flags."""
  flags.DEFINE_string('mix', None, 'A mix name from olmo_core/data/mixes/ (e.g. '
                      'OLMo-mix-0925-official) or a path to a mix file.')
  flags.DEFINE_string(
      'base_url', 'https://olmo-data.org', "Root the mix's paths are joined to (OLMo-core's "
      'default --data-root; a gs:// or s3:// bucket prefix, or a local directory, also work).')
  flags.DEFINE_string('output_dir', None, 'Writes the files (and the local mix) into this '
                      'local folder.')
  flags.DEFINE_string(
      'tokenizer_id', '', "Substituted for {TOKENIZER}; '' -> OLMo-core's id for dolma2 and this "
      'mix (allenai/dolma3-tokenizer for the Olmo 3 mixes).')
  flags.DEFINE_bool('list', False, 'Print files, bytes and tokens per source; download '
                    'nothing.')
  flags.DEFINE_list('labels', [], 'Only these sources (mix labels); default all.')
  flags.DEFINE_integer('max_files', 0, 'Only the first N files (0: all), to try a '
                       'mix out.')
  flags.DEFINE_string('checksums', '', 'A sha256sum-style file (`HEX  relative/path` '
                      'lines) when the source publishes checksums.')
  flags.DEFINE_bool(
      'skip_missing', False, 'Write the local mix without files the server does not have (404). '
      "The instance ids, and so the data order, then differ from Ai2's run.")
  flags.DEFINE_string('local_mix', '', "Local mix file to write; '' -> "
                      'OUTPUT_DIR/<mix name>.txt.')
  flags.DEFINE_string('remote_mix', '', 'Download nothing: write this mix of the files\' URLs '
                      'and sizes (`label,url,bytes`), for train.py to read them remotely.')
  flags.DEFINE_integer('seq_len', 8192, '--list: instances per source at this length '
                       '(OLMo-core pretrain-1: 8192).')
  flags.DEFINE_integer('workers', 8, 'Parallel downloads (and HEAD requests).')
  flags.DEFINE_integer('retries', 5, 'Retries per file after a failure.')
  flags.DEFINE_float('timeout', 60.0, 'Seconds without progress before a retry.')


if __name__ == '__main__':
  define_flags()
  app.run(main)
