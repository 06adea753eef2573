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

// The rung a `version=` string names, or nullopt for None: the chapter's own dispatch then picks
// by size, dtype, alignment and shape (CONTRIBUTING.md, section 3). The same names are accepted on
// every device, so a typo fails on the CPU exactly as it would on CUDA.
template <typename Version, size_t N>
std::optional<Version> parse_version(const char* op, OptVersion version,
                                     const NamedVersion<Version> (&table)[N]) {
  if (!version.has_value()) return std::nullopt;
  std::string list;
  for (const auto& v : table) {
    if (as_std(*version) == v.name) return v.version;
    list += (list.empty() ? "" : ", ") + std::string(v.name);
  }
  TORCH_CHECK(false, op, ": unknown version '", std::string(as_std(*version)),
              "'; expected one of ", list, " (or None for the default dispatch)");
}

// The name of a rung, for reporting what the dispatch chose.
template <typename Version, size_t N>
std::string version_name(const NamedVersion<Version> (&table)[N], Version version) {
  for (const auto& v : table) {
    if (v.version == version) return v.name;
  }
  TORCH_CHECK(false, "unreachable: a version missing from its table");
}

}  // namespace course
