// The `version=` argument of every course op, for the torch glue layer: one table of
// (name, enum) pairs per ladder, parsed the same way in every chapter, so the names Python
// sees, the error for a typo and the `versions` op that tests hold against the Python
// VERSIONS table all come from that one table.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace course {

using OptVersion = std::optional<c10::string_view>;

// c10::string_view is std::string_view in recent torch and its own class in older releases;
// both have data() and size().
inline std::string_view as_std(c10::string_view s) { return {s.data(), s.size()}; }

template <typename Version>
struct NamedVersion {
  const char* name;
  Version version;
};

template <typename Version, size_t N>
std::vector<std::string> version_names(const NamedVersion<Version> (&table)[N]) {
  std::vector<std::string> names;
  for (const auto& v : table) names.emplace_back(v.name);
  return names;
}

// None picks `best`; the same names are accepted on every device, so a typo fails on the CPU
// exactly as it would on CUDA.
template <typename Version, size_t N>
Version parse_version(const char* op, OptVersion version, const NamedVersion<Version> (&table)[N],
                      Version best) {
  if (!version.has_value()) return best;
  std::string list;
  for (const auto& v : table) {
    if (as_std(*version) == v.name) return v.version;
    list += (list.empty() ? "" : ", ") + std::string(v.name);
  }
  TORCH_CHECK(false, op, ": unknown version '", std::string(as_std(*version)),
              "'; expected one of ", list, " (or None for the best)");
}

}  // namespace course
