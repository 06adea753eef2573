// The `fusion` ops library: its one TORCH_LIBRARY block and the `versions` op every course
// library has (coursekit.loader recognises a loaded library by it). The ops themselves are
// declared and registered by their families' glue files, elementwise_ops.cpp and
// norm_ops.cpp, each with TORCH_LIBRARY_FRAGMENT.
#include "fusion_ops.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

namespace fusion {
namespace {

std::vector<std::string> versions(c10::string_view op) {
  const std::string_view name(op.data(), op.size());
  if (auto v = elementwise_versions(name)) return *v;
  if (auto v = norm_versions(name)) return *v;
  TORCH_CHECK(false, "versions: unknown op '", std::string(name), "'");
}

}  // namespace
}  // namespace fusion

TORCH_LIBRARY(fusion, m) {
  m.def("versions(str op) -> str[]", &fusion::versions);
}
