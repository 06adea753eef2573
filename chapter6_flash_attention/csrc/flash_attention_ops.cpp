// The `flash_attention` ops library: its one TORCH_LIBRARY block and the `versions` op every
// course library has (coursekit.loader recognises a loaded library by it). The ops themselves are
// declared and registered by the two parts' glue files, attention/attention_ops.cpp (training)
// and serving/serving_ops.cpp (serving), each with TORCH_LIBRARY_FRAGMENT.
#include "flash_attention_ops.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

namespace flash_attention {
namespace {

std::vector<std::string> versions(c10::string_view op) {
  const std::string_view name(op.data(), op.size());
  if (auto v = attention_versions(name)) return *v;
  if (auto v = serving_versions(name)) return *v;
  TORCH_CHECK(false, "versions: unknown op '", std::string(name),
              "' (flash_attention has attention_forward, attention_backward and paged_attention)");
}

}  // namespace
}  // namespace flash_attention

TORCH_LIBRARY(flash_attention, m) {
  m.def("versions(str op) -> str[]", &flash_attention::versions);
}
