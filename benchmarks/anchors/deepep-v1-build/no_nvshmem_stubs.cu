// Host definitions for an intranode-only DeepEP V1 build (-DDISABLE_NVSHMEM).
//
// deep_ep.cpp binds Buffer.low_latency_{update,query,clean}_mask_buffer unconditionally, so it
// references these three functions even when NVSHMEM is off; their only definitions live in
// internode_ll.cu, which such a build leaves out. Without these the extension does not load
// (undefined symbols). Each one throws: the low-latency kernels do not exist in this build.
// The signatures follow the declarations in csrc/kernels/api.cuh of DeepEP 567632dd.

#include <stdexcept>
#include <string>

#include "api.cuh"

namespace deep_ep {
namespace internode_ll {

namespace {

[[noreturn]] void unavailable(const char* name) {
    throw std::runtime_error(std::string("deep_ep: internode_ll::") + name +
                             " is not available: this build has intranode kernels only (built without NVSHMEM)");
}

}  // namespace

void query_mask_buffer(int*, int, int*, cudaStream_t) {
    unavailable("query_mask_buffer");
}

void update_mask_buffer(int*, int, bool, cudaStream_t) {
    unavailable("update_mask_buffer");
}

void clean_mask_buffer(int*, int, cudaStream_t) {
    unavailable("clean_mask_buffer");
}

}  // namespace internode_ll
}  // namespace deep_ep
