// What the `fusion` library's one TORCH_LIBRARY block (fusion_ops.cpp) needs from each op
// family's glue file: the version table of each op with a ladder, by op name. Each family
// registers its own ops (TORCH_LIBRARY_FRAGMENT) beside its kernels' launchers.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fusion {

// The rung names of `op` (fusion.VERSIONS is tested against them), or nullopt when the op is
// not this family's. elementwise_ops.cpp: bias_scale_relu, its backward, the activations and
// linear_activation; norm_ops.cpp: layer_norm, rms_norm, fused_add_rms_norm and their
// backwards.
std::optional<std::vector<std::string>> elementwise_versions(std::string_view op);
std::optional<std::vector<std::string>> norm_versions(std::string_view op);

}  // namespace fusion
