// The device API without the CUDA backend (K3_CUDA off): availability says no, and every call
// that needs a GPU throws one clear error. device_cuda.cu replaces this file when CUDA is built.
#if !defined(K3_HAS_CUDA)
#include "core/device.h"

#include "core/error.h"

namespace k3::device {
namespace {
[[noreturn]] void unavailable() {
  throw error("device", "this k3 was built without the CUDA backend (configure with -DK3_CUDA=ON)");
}
}  // namespace

bool cuda_built() { return false; }
int cuda_device_count() { return 0; }
void require_cuda(const char* who) {
  throw error(who, "--device cuda: this k3 was built without the CUDA backend (configure with -DK3_CUDA=ON); "
                   "use --device cpu");
}
const char* describe() { return "no CUDA backend in this build"; }
int sm_count() { unavailable(); }
Buffer::Buffer(size_t bytes) {
  if (bytes) unavailable();
}
Buffer::~Buffer() = default;
HostPin::HostPin(void*, size_t) {}  // nothing to lock without the backend
HostPin::~HostPin() = default;
HostPin& HostPin::operator=(HostPin&& o) noexcept {
  ptr_ = std::exchange(o.ptr_, nullptr);
  return *this;
}
Buffer& Buffer::operator=(Buffer&& o) noexcept {
  ptr_ = std::exchange(o.ptr_, nullptr);
  bytes_ = std::exchange(o.bytes_, 0);
  return *this;
}
AllocatorStats allocator_stats() { return {}; }
void empty_cache() {}
size_t available_bytes() { return 0; }
void upload(void*, const void*, size_t, Refresh) { unavailable(); }
void download(void*, const void*, size_t) { unavailable(); }
void zero(void*, size_t) { unavailable(); }
void copy(void*, const void*, size_t) { unavailable(); }
void copy_rows(void*, size_t, const void*, size_t, size_t, size_t rows) {
  if (rows) unavailable();
}
void synchronize() {}
Buffer upload_new(const void*, size_t bytes, Refresh) {
  if (bytes) unavailable();
  return {};
}
Buffer upload_values(const float*, int64_t n, Storage) {
  if (n) unavailable();
  return {};
}
void download_values(float*, const Buffer&, int64_t n, Storage) {
  if (n) unavailable();
}
Buffer zeros_f32(int64_t n) {
  if (n) unavailable();
  return {};
}
Graph::~Graph() = default;
void Graph::begin(int64_t) { unavailable(); }
void Graph::end() {}
void Graph::abort() {}
void Graph::set_input(const int64_t*, int64_t) { unavailable(); }
void Graph::replay() {}
int64_t Graph::slots(Refresh) const { return 0; }
void Graph::release() {}
bool capturing() { return false; }
Timer::Timer() { unavailable(); }
Timer::~Timer() = default;
void Timer::start() {}
double Timer::stop_ms() { return 0.0; }

}  // namespace k3::device
#endif
