"""The tree's layers: what may import what, read from every import of every module (AST).

The root holds the entry points and the step's spine; every other module lives in a
package named for what it keeps. LAYERS lists them from the top down. A module may
import its own package and anything in a lower layer, never its own layer or one above:
so nothing imports an entry point, two packages of one layer never lean on each other,
and no chain of imports comes back to where it started. A new root module or package
fails here until it has a place in LAYERS (and a line in docs/architecture.md#layers).
scripts/, bench/ and tests/ use the tree from outside and are not layered.
"""

import ast
import collections
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT_MODULES_AIM = 12  # the spine and the entry points: a root a newcomer can scan

# Top down. A name is a root module (name.py) or a package (name/__init__.py).
LAYERS = (
    ('plan', 'eval', 'convert'),         # entry points: only a user runs them
    ('train',),                          # the step and the loop; plan.py compiles its step
    ('config_checks',),                  # what every entry point runs first
    ('evaluation',),                     # scoring, suites, in-loop evaluation, the sample
    ('formats', 'monitor'),              # other checkpoint formats; watching a run
    ('configs',),                        # one get_config() per recipe
    ('checkpoint', 'data', 'sharding'),  # the spine's state, data order and layout
    ('tokens', 'hosts'),                 # token files and batches; a run's processes
    ('model', 'loss', 'optim'),          # the math
    ('store', 'kernels'),                # where bytes live; the speed paths
    ('errors',),                         # exit codes: imported by nearly everything
)
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _units() -> dict[str, bool]:
  """{name: is_package} for every root module and every package at the root."""
  units = {}
  for entry in os.listdir(REPO):
    path = os.path.join(REPO, entry)
    if entry.endswith('.py') and os.path.isfile(path):
      units[entry[:-3]] = False
    elif os.path.isfile(os.path.join(path, '__init__.py')):
      units[entry] = True
  return units


def _files(units: dict[str, bool]):
  """(module name, path) for every layered file: root modules and packages' modules."""
  for name, is_package in sorted(units.items()):
    if not is_package:
      yield name, os.path.join(REPO, f'{name}.py')
      continue
    for root, dirs, files in os.walk(os.path.join(REPO, name)):
      dirs[:] = sorted(d for d in dirs if d != '__pycache__')
      for file in sorted(files):
        if file.endswith('.py'):
          rel = os.path.relpath(os.path.join(root, file), REPO)[:-3].split(os.sep)
          module = '.'.join(rel[:-1] if rel[-1] == '__init__' else rel)
          yield module, os.path.join(root, file)


def _imports(module: str, path: str, known: set[str]):
  """(imported project module, line) for every import in the file, lazy ones included."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  package = module if path.endswith('__init__.py') else module.rpartition('.')[0]
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        parts = package.split('.')[:len(package.split('.')) - node.level + 1]
        base = '.'.join(parts + ([base] if base else []))
      # `from pkg import mod` imports pkg.mod when it is a module, else a name of pkg.
      targets = [f'{base}.{a.name}' if f'{base}.{a.name}' in known else base
                 for a in node.names]
    else:
      continue
    for target in targets:
      while target and target not in known:  # `import a.b.c`: the deepest project module
        target = target.rpartition('.')[0]
      if target:
        yield target, node.lineno


def _graph():
  units = _units()
  files = dict(_files(units))
  known = set(files)
  graph = {m: sorted(set(_imports(m, p, known))) for m, p in files.items()}
  return units, files, graph


def test_every_module_has_a_layer():
  units, _, _ = _graph()
  missing = sorted(set(units) - set(LAYER))
  stale = sorted(set(LAYER) - set(units))
  assert not missing, (f'not in LAYERS (give each a layer, and a line in '
                       f'docs/architecture.md): {missing}')
  assert not stale, f'in LAYERS but not in the tree: {stale}'


def test_no_upward_import():
  _, files, graph = _graph()
  found = []
  for module, imports in graph.items():
    unit = module.split('.')[0]
    for target, line in imports:
      other = target.split('.')[0]
      if other != unit and LAYER[other] <= LAYER[unit]:
        where = 'its own layer' if LAYER[other] == LAYER[unit] else 'a layer above'
        found.append(f'{os.path.relpath(files[module], REPO)}:{line} imports {target}, '
                     f'from {where} ({", ".join(LAYERS[LAYER[other]])})')
  assert not found, 'imports against the layers:\n' + '\n'.join(found)


def test_no_import_circle():
  _, _, graph = _graph()
  edges = {m: sorted({t for t, _ in imports if t != m}) for m, imports in graph.items()}
  state, circles = collections.defaultdict(int), []  # 0 new, 1 on the path, 2 done

  def visit(module, path):
    state[module] = 1
    for target in edges[module]:
      if state[target] == 1:
        circles.append(' -> '.join(path[path.index(target):] + [target]))
      elif state[target] == 0:
        visit(target, path + [target])
    state[module] = 2

  for module in sorted(edges):
    if state[module] == 0:
      visit(module, [module])
  assert not circles, 'import circles:\n' + '\n'.join(circles)


def test_root_stays_small():
  units, _, _ = _graph()
  root = sorted(name for name, is_package in units.items() if not is_package)
  assert len(root) <= ROOT_MODULES_AIM, (
      f'{len(root)} modules at the root (aim: {ROOT_MODULES_AIM}): {root}; put the new one in '
      'the package that keeps what it keeps')


def test_each_package_says_what_it_keeps():
  units, _, _ = _graph()
  for name, is_package in sorted(units.items()):
    if is_package:
      with open(os.path.join(REPO, name, '__init__.py')) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ''
      assert len(doc.splitlines()) >= 3 and 'import' in doc, (
          f'{name}/__init__.py: its docstring says what the package keeps and what it may '
          f'import, in three lines or more: {doc!r}')


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
  """The walker finds what it must refuse (so the tests above cannot pass vacuously)."""
  (tmp_path / 'store').mkdir()
  (tmp_path / 'store' / '__init__.py').write_text('')
  (tmp_path / 'store' / 'storage.py').write_text('def f():\n  from monitor import health\n')
  (tmp_path / 'monitor').mkdir()
  (tmp_path / 'monitor' / '__init__.py').write_text('')
  (tmp_path / 'monitor' / 'health.py').write_text('from store import storage\nimport errors\n')
  (tmp_path / 'errors.py').write_text('')
  monkeypatch.setattr(sys.modules[__name__], 'REPO', str(tmp_path))
  _, _, graph = _graph()
  assert graph['store.storage'] == [('monitor.health', 2)]
  assert set(graph['monitor.health']) == {('store.storage', 1), ('errors', 2)}
  with pytest.raises(AssertionError, match=r'store/storage.py:2 imports monitor.health, from a '
                                           r'layer above'):
    test_no_upward_import()
  with pytest.raises(AssertionError, match='monitor.health -> store.storage -> monitor.health'):
    test_no_import_circle()
