"""The C++ rule names @bazel_tools loads from @rules_cc, bound to Bazel's native rules.

Bazel 4.2.3 (Debian's bazel-bootstrap) loads `@rules_cc//cc:defs.bzl` as soon as it
resolves any toolchain, and would download rules_cc for it. Debian's own bazel-rules-cc
package is a newer release that needs Bazel 5 (`use_cpp_toolchain`). Bazel 4 still has
every one of these rules built in, so this file only names them. tfdpx builds no C++.
"""

cc_binary = native.cc_binary
cc_import = native.cc_import
cc_library = native.cc_library
cc_proto_library = native.cc_proto_library
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
objc_import = native.objc_import
objc_library = native.objc_library
