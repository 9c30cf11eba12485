#include "sparktune/registry.h"

namespace sparktune {

Registry& Registry::instance() {
  static Registry* registry = [] {
    auto* r = new Registry();
    register_all_kernels(*r);
    return r;
  }();
  return *registry;
}

const KernelInfo* Registry::find(const std::string& name) const {
  for (const auto& k : kernels_) {
    if (k.name == name) return &k;
  }
  return nullptr;
}

}  // namespace sparktune
