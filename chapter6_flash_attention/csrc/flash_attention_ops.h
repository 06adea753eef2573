// What the `flash_attention` library's one TORCH_LIBRARY block (flash_attention_ops.cpp) needs
// from each part of the chapter: the version table of each op with a ladder, by op name. Each
// part registers its own ops (TORCH_LIBRARY_FRAGMENT) beside its kernels' launchers, so that
// neither part's glue includes the other's header.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace flash_attention {

// The rung names of `op` (flash_attention.VERSIONS is tested against them), or nullopt when the
// op is not this part's. attention/attention_ops.cpp: attention_forward and attention_backward;
// serving/serving_ops.cpp: paged_attention.
std::optional<std::vector<std::string>> attention_versions(std::string_view op);
std::optional<std::vector<std::string>> serving_versions(std::string_view op);

}  // namespace flash_attention
