// safetensors: zero-copy mmap reading, atomic writing, sharded checkpoints.
// Format: u64 little-endian header length N, N bytes of JSON header, then the data bytes.
// Every header field is validated before any data is touched: a malformed file raises a
// k3::Error naming the file and the problem and never reads out of bounds.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace k3 {

struct TensorEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin = 0, end = 0;  // byte offsets relative to the data section
};

class SafeTensors {
 public:
  static SafeTensors open(const std::string& path);  // mmap the file, parse and validate
  // Parses an in-memory buffer (the fuzzers use this); `name` is used in messages.
  static SafeTensors from_buffer(std::shared_ptr<const std::vector<char>> buffer, const std::string& name);

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  std::vector<std::string> names() const;  // sorted
  bool has(const std::string& name) const { return entries_.count(name) != 0; }
  const TensorEntry& entry(const std::string& name) const;
  // A view of the tensor in its stored dtype. Zero-copy when the data is aligned for its dtype,
  // otherwise an aligned copy.
  Tensor get(const std::string& name) const;
  // The tensor converted to fp32 (a view when it is already fp32 and aligned).
  Tensor get_f32(const std::string& name) const;

 private:
  std::string path_;
  std::shared_ptr<const char> base_;  // start of the mapping (keeps it alive)
  const char* data_ = nullptr;        // start of the data section
  uint64_t data_size_ = 0;
  std::map<std::string, TensorEntry> entries_;
  std::map<std::string, std::string> metadata_;

  void parse(const char* bytes, uint64_t size);
};

// A checkpoint folder: model.safetensors, or shards listed by model.safetensors.index.json.
class Checkpoint {
 public:
  static Checkpoint open(const std::string& path);  // a folder or a single .safetensors file
  bool has(const std::string& name) const { return where_.count(name) != 0; }
  std::vector<std::string> names() const;
  Tensor get(const std::string& name) const;      // stored dtype
  Tensor get_f32(const std::string& name) const;  // converted to fp32
  const TensorEntry& entry(const std::string& name) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<SafeTensors> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index in files_
};

// Writes tensors (any dtype, contiguous or not) atomically: a temporary file in the same
// folder, fsync, then rename over `path`. Names are written in sorted order.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace k3
