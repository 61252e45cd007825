#!/bin/sh
# `bazel coverage` needs Bazel's coverage tools, which are downloaded and so are not
# available offline; `bazel test` never runs this.
echo "bazel coverage is not supported offline" >&2
exit 1
