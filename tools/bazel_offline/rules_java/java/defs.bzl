"""The Java rule names @bazel_tools loads from @rules_java, bound to Bazel's native rules.

Bazel 4.2.3 parses `@bazel_tools//tools/jdk` (registered Java toolchains) while it
resolves the Python toolchain, and that package loads `@rules_java//java:defs.bzl`,
which Bazel would download. Bazel 4 has these rules built in, so this file only names
them. tfdpx builds no Java.
"""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_plugin = native.java_plugin
java_proto_library = native.java_proto_library
java_runtime = native.java_runtime
java_test = native.java_test
java_toolchain = native.java_toolchain
