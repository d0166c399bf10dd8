// The device layer on CUDA: one stream, a caching allocator, copies, events.
//
// Allocator: sizes round up to 512 B below 1 MiB and to 2 MiB above; a freed block goes to the
// free list of its rounded size and is handed out again for the same class. No splitting or
// merging: simple, and the loops k3 runs (decode, training steps) ask for the same sizes again and
// again. When cudaMalloc fails the free lists are emptied once and the call retried.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/cuda_util.cuh"
#include "core/dtype.h"
#include "core/device.h"

namespace k3::device {

void cuda_fail(cudaError_t e, const char* what, const char* file, int line) {
  throw error("cuda", cudaGetErrorName(e), " (", cudaGetErrorString(e), ") from ", what, " at ", file, ":", line);
}

namespace {

size_t round_size(size_t bytes) {
  constexpr size_t kSmall = size_t(1) << 20, kSmallGrain = 512, kLargeGrain = size_t(2) << 20;
  const size_t grain = bytes < kSmall ? kSmallGrain : kLargeGrain;
  return (bytes + grain - 1) / grain * grain;
}

// Blocks handed out while this thread captures a Graph (the graph's reserved_ list), or null.
thread_local std::vector<void*>* t_reserve = nullptr;
// Blocks of that capture already freed during it, by rounded size: later allocations of the same
// capture reuse them (one stream: the graph runs them in the order they were captured).
thread_local std::map<size_t, std::vector<void*>>* t_capture_free = nullptr;

struct Allocator {
  std::mutex mu;
  std::map<size_t, std::vector<void*>> free_lists;  // rounded size -> blocks
  std::unordered_map<void*, size_t> live;            // block -> rounded size
  struct Held {
    size_t size;
    const std::vector<void*>* graph;  // the reserved_ list of the graph holding the block
  };
  std::unordered_map<void*, Held> reserved;  // blocks graphs hold
  AllocatorStats stats;

  void* get(size_t bytes) {
    const size_t size = round_size(bytes);
    std::lock_guard<std::mutex> lock(mu);
    void* p = nullptr;
    if (t_capture_free) {  // a block this capture already freed: reserved for it already
      auto c = t_capture_free->find(size);
      if (c != t_capture_free->end() && !c->second.empty()) {
        p = c->second.back();
        c->second.pop_back();
        live[p] = size;
        stats.in_use += size;
        if (stats.in_use > stats.peak) stats.peak = stats.in_use;
        return p;
      }
    }
    auto it = free_lists.find(size);
    if (it != free_lists.end() && !it->second.empty()) {
      p = it->second.back();
      it->second.pop_back();
      stats.cached -= size;
    } else {
      cudaError_t e = cudaMalloc(&p, size);
      if (e == cudaErrorMemoryAllocation && !t_reserve) {  // (a capture cannot wait for the stream)
        (void)cudaGetLastError();
        release_locked();
        e = cudaMalloc(&p, size);
      }
      if (e != cudaSuccess && e != cudaErrorMemoryAllocation) cuda_fail(e, "cudaMalloc", __FILE__, __LINE__);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        throw error("cuda", "out of device memory: asked for ", bytes, " bytes with ", stats.in_use,
                    " in use by k3 and ", free_b, " of ", total_b, " free on the device");
      }
      ++stats.mallocs;
    }
    live[p] = size;
    if (t_reserve) t_reserve->push_back(p), reserved[p] = {size, t_reserve};
    stats.in_use += size;
    if (stats.in_use > stats.peak) stats.peak = stats.in_use;
    return p;
  }
  void put(void* p) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = live.find(p);
    if (it == live.end()) return;
    const size_t size = it->second;
    live.erase(it);
    stats.in_use -= size;
    auto held = reserved.find(p);
    if (held != reserved.end()) {  // a graph's kernels still write it: back when the graph goes
      if (t_capture_free && held->second.graph == t_reserve) (*t_capture_free)[size].push_back(p);
      return;
    }
    stats.cached += size;
    free_lists[size].push_back(p);
  }
  void unreserve(const std::vector<void*>& blocks) {
    std::lock_guard<std::mutex> lock(mu);
    for (void* p : blocks) {
      auto it = reserved.find(p);
      if (it == reserved.end()) continue;
      const size_t size = it->second.size;
      reserved.erase(it);
      if (!live.count(p)) stats.cached += size, free_lists[size].push_back(p);
    }
  }
  void release_locked() {
    // Blocks may still be in use by queued kernels of their last owner: wait first.
    cudaStreamSynchronize(stream());
    for (auto& [size, blocks] : free_lists)
      for (void* p : blocks) cudaFree(p);
    free_lists.clear();
    stats.cached = 0;
  }
};

Allocator& allocator() {
  static Allocator* a = new Allocator();  // never destroyed: buffers may outlive static teardown
  return *a;
}

}  // namespace

cudaStream_t stream() {
  static cudaStream_t s = [] {
    require_cuda("device");
    cudaStream_t st = nullptr;
    K3_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    return st;
  }();
  return s;
}

bool cuda_built() { return true; }

int cuda_device_count() {
  static const int n = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return count;
  }();
  return n;
}

void require_cuda(const char* who) {
  if (cuda_device_count() > 0) return;
  int driver = 0;
  cudaDriverGetVersion(&driver);
  if (driver == 0)
    throw error(who, "CUDA needs a GPU and no NVIDIA driver was found on this machine; run on the CPU "
                     "(--device cpu) or on a machine with an NVIDIA GPU");
  throw error(who, "CUDA needs a GPU and the driver (CUDA ", driver / 1000, ".", driver % 1000 / 10,
              ") reports none usable; run on the CPU (--device cpu)");
}

int sm_count() {
  static const int n = [] {
    int v = 0;
    K3_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 0));
    return v;
  }();
  return n;
}

const char* describe() {
  static const std::string text = [] {
    if (cuda_device_count() == 0) return std::string("no CUDA device");
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return std::string("CUDA device 0 (properties unreadable)");
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s, %d SMs, %.1f GiB, sm_%d%d", p.name, p.multiProcessorCount,
                  double(p.totalGlobalMem) / double(1 << 30), p.major, p.minor);
    return std::string(buf);
  }();
  return text.c_str();
}

Buffer::Buffer(size_t bytes) : bytes_(bytes) {
  if (!bytes) return;
  require_cuda("device");
  ptr_ = allocator().get(bytes);
}
Buffer::~Buffer() {
  if (ptr_) allocator().put(ptr_);
}
Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) allocator().put(ptr_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

HostPin::HostPin(void* host, size_t bytes) {
  if (!host || !bytes || cuda_device_count() == 0) return;
  if (cudaHostRegister(host, bytes, cudaHostRegisterDefault) == cudaSuccess)
    ptr_ = host;
  else
    (void)cudaGetLastError();  // not locked: copies stay pageable (and correct)
}
HostPin::~HostPin() {
  if (ptr_) (void)cudaHostUnregister(ptr_);
}
HostPin& HostPin::operator=(HostPin&& o) noexcept {
  if (this != &o) {
    if (ptr_) (void)cudaHostUnregister(ptr_);
    ptr_ = std::exchange(o.ptr_, nullptr);
  }
  return *this;
}

AllocatorStats allocator_stats() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  return allocator().stats;
}
void empty_cache() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  allocator().release_locked();
}

size_t available_bytes() {
  size_t free_b = 0, total_b = 0;
  K3_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return free_b + allocator_stats().cached;
}

namespace {
// Pinned staging ring for small uploads (index lists, positions, token ids): the host bytes are
// copied into the ring and the device copy is queued without waiting, so a decode step's many
// small uploads do not each drain the stream. When the ring wraps, the stream is synchronised
// once: every copy queued from the previous lap has then read its bytes.
struct Staging {
  static constexpr size_t kCap = size_t(8) << 20, kMaxUpload = kCap / 8, kAlign = 256;
  std::mutex mu;
  char* base = nullptr;
  bool unavailable = false;
  size_t head = 0;
};
Staging& staging() {
  static Staging* s = new Staging();  // never destroyed, like the allocator
  return *s;
}
}  // namespace

// The Graph this thread is capturing, or null.
thread_local Graph* t_capture = nullptr;

struct CaptureAccess {
  static void add_slot(Graph& g, void* dst, const void* src, size_t bytes, Refresh refresh) {
    if (refresh == Refresh::None)
      throw error("graph", "an upload of ", bytes, " bytes during a graph capture has no refresh rule: this step ",
                  "cannot be replayed");
    if (refresh == Refresh::Advance && bytes % sizeof(int64_t))
      throw error("graph", "an advancing upload of ", bytes, " bytes is not a whole number of int64 values");
    if (refresh == Refresh::Input && g.slots(Refresh::Input))
      throw error("graph", "a second input upload during one capture");
    Graph::Slot slot{nullptr, bytes, refresh};
    K3_CUDA_CHECK(cudaHostAlloc(&slot.host, bytes, cudaHostAllocDefault));
    std::memcpy(slot.host, src, bytes);
    g.slots_.push_back(slot);
    K3_CUDA_CHECK(cudaMemcpyAsync(dst, slot.host, bytes, cudaMemcpyHostToDevice, stream()));
  }
};

bool capturing() { return t_capture != nullptr; }

void upload(void* dst, const void* src, size_t bytes, Refresh refresh) {
  if (!bytes) return;
  if (t_capture) return CaptureAccess::add_slot(*t_capture, dst, src, bytes, refresh);
  Staging& s = staging();
  if (bytes <= Staging::kMaxUpload) {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.base && !s.unavailable && cudaHostAlloc(reinterpret_cast<void**>(&s.base), Staging::kCap, cudaHostAllocDefault) != cudaSuccess) {
      (void)cudaGetLastError();
      s.base = nullptr;
      s.unavailable = true;  // no pinned memory: the synchronous path below
    }
    if (s.base) {
      if (s.head + bytes > Staging::kCap) {
        K3_CUDA_CHECK(cudaStreamSynchronize(stream()));
        s.head = 0;
      }
      std::memcpy(s.base + s.head, src, bytes);
      K3_CUDA_CHECK(cudaMemcpyAsync(dst, s.base + s.head, bytes, cudaMemcpyHostToDevice, stream()));
      s.head += (bytes + Staging::kAlign - 1) / Staging::kAlign * Staging::kAlign;
      return;
    }
  }
  K3_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream()));
  K3_CUDA_CHECK(cudaStreamSynchronize(stream()));  // the host buffer may be pageable and short-lived
}
void download(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  K3_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream()));
  K3_CUDA_CHECK(cudaStreamSynchronize(stream()));
}
void zero(void* dst, size_t bytes) {
  if (bytes) K3_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream()));
}
void copy(void* dst, const void* src, size_t bytes) {
  if (bytes) K3_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream()));
}
void copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes, size_t rows) {
  if (rows && row_bytes)
    K3_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows, cudaMemcpyDeviceToDevice, stream()));
}
void synchronize() { K3_CUDA_CHECK(cudaStreamSynchronize(stream())); }

Buffer upload_new(const void* src, size_t bytes, Refresh refresh) {
  Buffer b(bytes);
  if (bytes && src) upload(b.get(), src, bytes, refresh);
  return b;
}

Buffer upload_values(const float* src, int64_t n, Storage storage) {
  if (!src || n <= 0) return {};
  if (storage == Storage::F32) return upload_new(src, size_t(n) * sizeof(float));
  std::vector<uint16_t> h(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) h[size_t(i)] = f32_to_bf16(src[i]);
  return upload_new(h.data(), h.size() * sizeof(uint16_t));
}

void download_values(float* dst, const Buffer& src, int64_t n, Storage storage) {
  if (!dst || n <= 0) return;
  if (storage == Storage::F32) return download(dst, src.get(), size_t(n) * sizeof(float));
  std::vector<uint16_t> h(static_cast<size_t>(n));
  download(h.data(), src.get(), h.size() * sizeof(uint16_t));
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(h[size_t(i)]);
}

Buffer zeros_f32(int64_t n) {
  Buffer b(size_t(n > 0 ? n : 0) * sizeof(float));
  zero(b.get(), b.bytes());
  return b;
}

Graph::~Graph() {
  if (t_capture == this) abort();
  release();
}
void Graph::release() {
  if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  if (graph_) cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
  if (done_) {
    cudaEventSynchronize(static_cast<cudaEvent_t>(done_));  // no replay still reads the slots
    cudaEventDestroy(static_cast<cudaEvent_t>(done_));
  }
  exec_ = graph_ = done_ = nullptr;
  for (Slot& s : slots_) cudaFreeHost(s.host);
  slots_.clear();
  allocator().unreserve(reserved_);
  reserved_.clear();
  replayed_ = false;
}
void Graph::begin(int64_t step_tokens) {
  if (t_capture) throw error("graph", "a capture is already under way on this thread");
  release();
  // Relaxed: the allocator may call cudaMalloc and the uploads cudaHostAlloc while capturing;
  // a synchronisation of the captured stream still fails (and so does the capture).
  K3_CUDA_CHECK(cudaStreamBeginCapture(stream(), cudaStreamCaptureModeRelaxed));
  step_tokens_ = step_tokens;
  t_capture = this;
  t_reserve = &reserved_;
  t_capture_free = &capture_free_;
}
void Graph::end() {
  if (t_capture != this) throw error("graph", "end() without begin()");
  t_capture = nullptr;
  t_reserve = nullptr;
  t_capture_free = nullptr;
  capture_free_.clear();
  cudaGraph_t g = nullptr;
  const cudaError_t e = cudaStreamEndCapture(stream(), &g);
  graph_ = g;
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    release();
    cuda_fail(e, "cudaStreamEndCapture", __FILE__, __LINE__);
  }
  cudaGraphExec_t x = nullptr;
  K3_CUDA_CHECK(cudaGraphInstantiate(&x, g, 0));
  exec_ = x;
  cudaEvent_t ev = nullptr;
  K3_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  done_ = ev;
}
void Graph::abort() {
  if (t_capture == this) {
    t_capture = nullptr;
    t_reserve = nullptr;
    t_capture_free = nullptr;
    capture_free_.clear();
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(stream(), &g);  // fails when the capture was invalidated: nothing to keep
    if (g) cudaGraphDestroy(g);
    (void)cudaGetLastError();
  }
  release();
}
int64_t Graph::slots(Refresh r) const {
  return int64_t(std::count_if(slots_.begin(), slots_.end(), [r](const Slot& s) { return s.refresh == r; }));
}
void Graph::set_input(const int64_t* ids, int64_t n) {
  auto it = std::find_if(slots_.begin(), slots_.end(), [](const Slot& s) { return s.refresh == Refresh::Input; });
  if (it == slots_.end()) throw error("graph", "set_input: the capture uploaded no input");
  if (size_t(n) * sizeof(int64_t) != it->bytes)
    throw error("graph", "set_input: ", n, " ids for a step captured with ", it->bytes / sizeof(int64_t));
  if (done_) K3_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(done_)));
  std::memcpy(it->host, ids, it->bytes);
}
void Graph::replay() {
  if (!exec_) throw error("graph", "replay() before a capture ended");
  auto advance = [&](int64_t by) {
    for (Slot& s : slots_)
      if (s.refresh == Refresh::Advance)
        for (size_t i = 0; i < s.bytes / sizeof(int64_t); ++i) static_cast<int64_t*>(s.host)[i] += by;
  };
  if (replayed_) {  // the first replay runs the captured step itself; later ones the next steps
    K3_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(done_)));
    advance(step_tokens_);
  }
  const cudaError_t e = cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), stream());
  if (e != cudaSuccess) {
    if (replayed_) advance(-step_tokens_);  // not launched: the slots go back to this step's values
    cuda_fail(e, "cudaGraphLaunch", __FILE__, __LINE__);
  }
  K3_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(done_), stream()));
  replayed_ = true;
}

Timer::Timer() {
  cudaEvent_t a, b;
  K3_CUDA_CHECK(cudaEventCreate(&a));
  K3_CUDA_CHECK(cudaEventCreate(&b));
  begin_ = a;
  end_ = b;
}
Timer::~Timer() {
  cudaEventDestroy(static_cast<cudaEvent_t>(begin_));
  cudaEventDestroy(static_cast<cudaEvent_t>(end_));
}
void Timer::start() { K3_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(begin_), stream())); }
double Timer::stop_ms() {
  K3_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(end_), stream()));
  K3_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(end_)));
  float ms = 0.0f;
  K3_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(begin_), static_cast<cudaEvent_t>(end_)));
  return double(ms);
}

}  // namespace k3::device
