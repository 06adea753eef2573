// The glue's typed handle on an op of its own library. Autograd Functions re-enter the
// dispatcher below the Autograd key through it (forward) and call the family's backward op
// (backward); call sites keep it in a function-local static, so the lookup happens once.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace course {

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace course
