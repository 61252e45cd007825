"""The package's modules import one another without a circle."""

import ast
import pathlib

import tfdpx

ROOT = pathlib.Path(tfdpx.__file__).parent


def _module_names():
  names = {}
  for path in ROOT.rglob('*.py'):
    parts = ('tfdpx',) + path.relative_to(ROOT).with_suffix('').parts
    if parts[-1] == '__init__':
      parts = parts[:-1]
    names['.'.join(parts)] = path
  return names


def _imports(path, modules):
  """The tfdpx modules that `path` imports, anywhere in it.

  `from package import submodule` counts as importing the submodule only:
  a package's `__init__` may gather its submodules without a circle.
  """
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name in modules)
    elif isinstance(node, ast.ImportFrom) and node.module in modules:
      submodules = {f'{node.module}.{a.name}' for a in node.names} & set(
          modules)
      found.update(submodules or {node.module})
  return found


def _cycle(graph):
  """One import circle of `graph` as a list of modules, or None."""
  state = {}  # module -> 'open' while on the path, 'done' after.

  def visit(module, path):
    state[module] = 'open'
    for target in sorted(graph[module]):
      if state.get(target) == 'open':
        return path[path.index(target):] + [target]
      if target not in state:
        found = visit(target, path + [target])
        if found:
          return found
    state[module] = 'done'
    return None

  for module in sorted(graph):
    if module not in state:
      found = visit(module, [module])
      if found:
        return found
  return None


def test_no_import_circle():
  modules = _module_names()
  graph = {name: _imports(path, modules) - {name}
           for name, path in modules.items()}
  assert _cycle(graph) is None, ' -> '.join(_cycle(graph))


def test_a_circle_is_found():
  graph = {'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}
  assert _cycle(graph) == ['a', 'b', 'c', 'a']
  assert _cycle({'a': {'b'}, 'b': set()}) is None
