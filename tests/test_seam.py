"""store/storage.py is the one module that knows where bytes live (an AST check of the tree).

Outside it, no module asks what a location's scheme is (`is_url`, `is_object_store`,
`scheme`, or a '://' test of its own): it calls the storage operation, which picks
the filesystem or the bucket implementation. A module that keeps two
implementations of one operation asks for the store's capability (`renames`,
`appends`, `maps`, `locks`), and only the callers listed here may ask it (or,
for one protocol detail, the scheme), each for the reason given. A new branch
on where bytes live fails this test until it moves into store/storage.py or earns a
line below.
"""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# store/kvstores.py: the transport only store/storage.py imports
SEAM = ('store/storage.py', 'store/kvstores.py')
SCHEME_QUERIES = {'is_url', 'is_object_store', 'scheme'}
CAPABILITIES = {'renames', 'appends', 'maps', 'locks'}

# (module, function): why it keeps a filesystem and a bucket implementation side by side.
ALLOWED = {
    ('tokens/token_files.py', 'memory_mapped'): 'maps: token files are memory-mapped where they '
                                                'can be, read by byte range where they cannot',
    ('monitor/metrics.py', 'MetricWriter.__init__'): 'appends: metrics.jsonl is one appended file, '
                                                     'or one segment object per flush',
    ('monitor/events.py', 'Writer.__init__'): 'appends: one TensorBoard event file appended to, or '
                                              'one event file per flush',
    ('hosts/workdir_lock.py', 'WorkdirLock.__enter__'): 'locks: flock on a filesystem, a renewed '
                                                        'lease in a bucket',
    ('formats/ckpt_files.py', 'install'): 'renames: a converted checkpoint replaces the old one by '
                                          'an atomic directory exchange, or step by step with '
                                          'COMMIT last',
    ('store/download.py', '_local_path'): "'://': a download's source: a path or file:// is "
                                          'copied, http(s) and public bucket URLs are fetched over '
                                          'HTTP',
    ('store/prefetch.py', 'Prefetch.__init__'): 'is_url: a checkpoint is read ahead from a '
                                                'filesystem only; in a bucket a store that is '
                                                'down would cost its retries twice',
    ('tokens/remote_tokens.py', 'probe'): "scheme: a token file's size is found by the request "
                                          'each protocol answers cheapest (HTTP Range, S3 error, '
                                          'GCS bisection)',
}


def _modules():
  for root, dirs, files in os.walk(REPO):
    dirs[:] = [d for d in dirs if not d.startswith('.') and d not in ('tests', 'build')]
    for name in files:
      if name.endswith('.py'):
        path = os.path.join(root, name)
        yield os.path.relpath(path, REPO), path


def _calls(tree: ast.AST):
  """(qualified function name, attribute called on `storage`, line) for every storage.X(...)
  call and every "'://' in ..." test."""
  def visit(node, scope):
    for child in ast.iter_child_nodes(node):
      name = scope
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        name = f'{scope}.{child.name}' if scope else child.name
      if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
          and isinstance(child.func.value, ast.Name) and child.func.value.id == 'storage'):
        yield scope, child.func.attr, child.lineno
      if (isinstance(child, ast.Compare) and isinstance(child.left, ast.Constant)
          and child.left.value == '://'):
        yield scope, "'://' in", child.lineno
      yield from visit(child, name)
  yield from visit(tree, '')


def test_only_storage_asks_where_bytes_live():
  found, capability_uses = [], set()
  for rel, path in _modules():
    if rel in SEAM:
      continue
    with open(path) as f:
      tree = ast.parse(f.read(), rel)
    for scope, attr, line in _calls(tree):
      if attr in CAPABILITIES | SCHEME_QUERIES | {"'://' in"}:
        capability_uses.add((rel, scope))
        if (rel, scope) not in ALLOWED:
          found.append(f'{rel}:{line} ({scope}) asks {attr} and is not in ALLOWED')
  assert not found, 'branches on where bytes live outside store/storage.py:\n' + '\n'.join(found)
  assert capability_uses == set(ALLOWED), f'stale ALLOWED entries: {set(ALLOWED) - capability_uses}'


def test_only_storage_imports_the_transport():
  importers = []
  for rel, path in _modules():
    with open(path) as f:
      tree = ast.parse(f.read(), rel)
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {f'{n.module}.{a.name}' for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
              for a in n.names}
    if 'store.kvstores' in names:
      importers.append(rel)
  assert importers == ['store/storage.py'], importers


def test_the_check_sees_a_branch():
  """The walker finds the shapes it must refuse (so the test above cannot pass vacuously)."""
  tree = ast.parse('from store import storage\n'
                   'def f(p):\n'
                   '  if storage.is_url(p) or "://" in p:\n'
                   '    return storage.renames(p)\n')
  assert [(s, a) for s, a, _ in _calls(tree)] == [('f', 'is_url'), ('f', "'://' in"),
                                                  ('f', 'renames')]
