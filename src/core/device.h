// The CUDA device as the rest of k3 sees it: availability, a caching allocator, copies and the
// stream every k3 kernel runs on. This header has no CUDA includes, so CPU-only code can ask
// "is there a GPU?" and move bytes without knowing about the toolkit. Built without CUDA
// (K3_CUDA off), every call that needs a device throws a clear k3::Error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace k3::device {

// True when this k3 was compiled with the CUDA backend.
bool cuda_built();
// The same at compile time. Code above core/ puts its device paths under
// `if constexpr (device::kCudaBuilt)`: they compile in every build, and a build without CUDA
// needs no definitions of the kernels they call (a discarded statement odr-uses nothing).
#if defined(K3_HAS_CUDA)
inline constexpr bool kCudaBuilt = true;
#else
inline constexpr bool kCudaBuilt = false;
#endif
// Number of usable CUDA devices (0 without the backend, without a driver or without a GPU).
int cuda_device_count();
// Throws "[who] --device cuda: ..." naming why CUDA is unusable (not built, no driver, no GPU).
void require_cuda(const char* who);
// "NVIDIA H200, 132 SMs, 139.8 GiB, sm_90" (or why there is none).
const char* describe();
// Streaming multiprocessors of the device (read once; throws without the backend).
int sm_count();

// Device memory from the caching allocator: freed blocks are kept by size class and reused, so
// the steady state of a training or decode loop makes no cudaMalloc/cudaFree calls.
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t bytes);
  ~Buffer();
  Buffer(Buffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* get() const { return ptr_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

struct AllocatorStats {
  size_t in_use = 0;     // bytes handed out and not yet freed
  size_t cached = 0;     // bytes held in the free lists
  size_t peak = 0;       // high-water mark of in_use
  size_t mallocs = 0;    // cudaMalloc calls so far
};
AllocatorStats allocator_stats();
void empty_cache();  // returns the free lists to the driver
// Bytes k3 could still allocate on the device: the driver's free memory plus k3's free lists.
size_t available_bytes();

// How an upload queued while a Graph is being captured is refreshed before each replay (a decode
// step replayed as a graph: one capture, then the same kernels on the next tokens).
enum class Refresh : uint8_t {
  None,      // not replayable: uploading during a capture throws (the capture is abandoned)
  Constant,  // the same bytes every step (tables of per-sequence pointers, RoPE frequencies)
  Advance,   // int64 values that move by the step's tokens every step (positions, cache lengths)
  Input,     // the step's token ids (Graph::set_input); one per graph
};

// Copies on k3's stream. upload returns once the host bytes have been read: small uploads go
// through a pinned staging ring and are queued without a stream sync, large ones wait for the copy.
// download waits for the copy (and so for everything queued before it).
void upload(void* dst_device, const void* src_host, size_t bytes, Refresh refresh = Refresh::None);
void download(void* dst_host, const void* src_device, size_t bytes);
void zero(void* dst_device, size_t bytes);
void copy(void* dst_device, const void* src_device, size_t bytes);  // device to device, queued
// `rows` rows of `row_bytes` each, device to device, between pitched layouts; queued.
void copy_rows(void* dst_device, size_t dst_pitch, const void* src_device, size_t src_pitch, size_t row_bytes,
               size_t rows);
void synchronize();  // waits for everything queued on k3's stream; throws on a kernel fault

// Upload a host array into a fresh buffer (nullptr/0 bytes gives an empty buffer).
Buffer upload_new(const void* src_host, size_t bytes, Refresh refresh = Refresh::None);
// fp32 host values stored on the device as fp32 or bf16 (`bf16` rounds to nearest even), and back.
enum class Storage : uint8_t { F32, BF16 };
Buffer upload_values(const float* src_host, int64_t n, Storage storage);
void download_values(float* dst_host, const Buffer& src, int64_t n, Storage storage);
Buffer zeros_f32(int64_t n);  // n fp32 zeros

// A CUDA graph of the work queued on k3's stream between begin() and end(): replaying it costs
// one launch for many kernels (the decode loop's many small kernels).
// - Uploads during the capture need a Refresh rule; each gets a pinned host slot of its own, which
//   replay() refreshes first (Advance: + step_tokens per int64; Input: set_input's ids).
// - Device memory handed out during the capture stays reserved for the graph until the graph is
//   destroyed, so the replays' kernels find their buffers intact: freed during the capture, a
//   block goes to the capture's later allocations only, never to other work.
// - A failed capture (an upload without a rule, a synchronising call, any CUDA error) throws from
//   the call that broke it; abort() then ends the capture and releases what it held.
class Graph {
 public:
  Graph() = default;
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  void begin(int64_t step_tokens = 0);
  void end();
  void abort();
  bool ready() const { return exec_ != nullptr; }
  void set_input(const int64_t* ids, int64_t n);  // the Input slot's next values (n must match)
  void replay();
  // Bookkeeping the capture made (uploads by rule), for reports and tests.
  int64_t slots(Refresh r) const;

  struct Slot {
    void* host = nullptr;
    size_t bytes = 0;
    Refresh refresh = Refresh::None;
  };

 private:
  friend struct CaptureAccess;
  void release();
  void* graph_ = nullptr;
  void* done_ = nullptr;  // event after the last replay: its copies have read the slots
  void* exec_ = nullptr;
  int64_t step_tokens_ = 0;
  bool replayed_ = false;
  std::vector<Slot> slots_;
  std::vector<void*> reserved_;
  std::map<size_t, std::vector<void*>> capture_free_;  // freed during the capture (allocator)
};
// True while a Graph is being captured on this thread: code whose launches bake in values that
// change from step to step (a host-side length in a kernel's parameters) refuses with this.
bool capturing();

// Page-locks an existing host range while it lives, so that downloads into it run at the link's
// rate instead of through the driver's pageable staging (a sampled decode step's B·V logits come
// back every step: 13 MB at 64 sequences of GPT-2). Where the range cannot be locked (no CUDA
// backend, no device, a failed registration), nothing is locked and copies stay pageable.
class HostPin {
 public:
  HostPin() = default;
  HostPin(void* host, size_t bytes);
  ~HostPin();
  HostPin(HostPin&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)) {}
  HostPin& operator=(HostPin&& o) noexcept;
  HostPin(const HostPin&) = delete;
  HostPin& operator=(const HostPin&) = delete;
  bool pinned() const { return ptr_ != nullptr; }

 private:
  void* ptr_ = nullptr;  // the registered range's start, or null
};

// Device-side timing for benchmarks: events on k3's stream.
class Timer {
 public:
  Timer();
  ~Timer();
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  void start();
  double stop_ms();  // waits, returns milliseconds since start()

 private:
  void* begin_ = nullptr;
  void* end_ = nullptr;
};

}  // namespace k3::device
