"""A Python toolchain whose interpreter is the project's `.venv/bin/python`.

`py_runtime` needs an absolute `interpreter_path`, and the checkout can live anywhere,
so this local repository rule (nothing is downloaded) finds `.venv` next to the
WORKSPACE file and writes the runtime, its `py_runtime_pair` and the `toolchain`.
Running the venv's own `python` is what makes its site-packages (TensorFlow,
tensorflow-privacy, dp-accounting, pytest, ...) importable; Bazel puts the runfiles
tree, and so this checkout's `tfdpx` and `tests`, ahead of them on `sys.path`.
"""

_BUILD = """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

py_runtime(
    name = "python3",
    interpreter_path = "{python}",
    python_version = "PY3",
    stub_shebang = "#!{python}",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":python3",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
"""

def _venv_python_impl(rctx):
    workspace = rctx.path(Label("@//:WORKSPACE")).dirname
    python = workspace.get_child(rctx.attr.venv).get_child("bin").get_child("python")
    if not python.exists:
        fail("%s does not exist: build the venv first (`make venv`; `make bazel-test` does it)" % python)
    rctx.file("WORKSPACE", 'workspace(name = "%s")\n' % rctx.name)
    rctx.file("BUILD", _BUILD.format(python = str(python)))

venv_python = repository_rule(
    implementation = _venv_python_impl,
    attrs = {"venv": attr.string(default = ".venv", doc = "The venv, relative to the workspace root.")},
    local = True,
    doc = "Registers nothing by itself: `register_toolchains(\"@<name>//:toolchain\")`.",
)
