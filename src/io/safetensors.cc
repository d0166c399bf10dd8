#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

namespace k3 {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {
constexpr uint64_t kMaxHeader = uint64_t(100) << 20;  // the reference implementation's limit

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw error("safetensors", path, ": ", what);
}
}  // namespace

SafeTensors SafeTensors::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) bad(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    bad(path, std::string("cannot stat: ") + std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    bad(path, "not a regular file");
  }
  uint64_t size = uint64_t(st.st_size);
  SafeTensors s;
  s.path_ = path;
  if (size < 8) {
    ::close(fd);
    bad(path, "file is " + std::to_string(size) + " bytes, too short for the 8-byte header length (truncated?)");
  }
  // Copy-on-write: reads are zero-copy; a model that trains (or is edited) in place gets private
  // pages and the file never changes.
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) bad(path, std::string("mmap failed: ") + std::strerror(errno));
  s.base_ = std::shared_ptr<const char>(static_cast<const char*>(p), [size](const char* q) {
    ::munmap(const_cast<char*>(q), size);
  });
  s.parse(s.base_.get(), size);
  return s;
}

SafeTensors SafeTensors::from_buffer(std::shared_ptr<const std::vector<char>> buffer, const std::string& name) {
  SafeTensors s;
  s.path_ = name;
  s.base_ = std::shared_ptr<const char>(buffer, buffer->data());
  if (buffer->size() < 8) bad(name, "buffer too short for the 8-byte header length");
  s.parse(buffer->data(), buffer->size());
  return s;
}

void SafeTensors::parse(const char* bytes, uint64_t size) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(bytes[i]);
  if (n > kMaxHeader) bad(path_, "header length " + std::to_string(n) + " exceeds the 100 MiB limit (corrupt file?)");
  if (n > size - 8)
    bad(path_, "header length " + std::to_string(n) + " runs past the end of the " + std::to_string(size) +
                   "-byte file (truncated?)");
  json h;
  try {
    h = json::parse(bytes + 8, bytes + 8 + n);
  } catch (const json::exception& e) {
    bad(path_, std::string("header is not valid JSON: ") + e.what());
  }
  if (!h.is_object()) bad(path_, "header is not a JSON object");
  data_ = bytes + 8 + n;
  data_size_ = size - 8 - n;

  std::vector<const TensorEntry*> order;
  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "__metadata__") {
      if (!v.is_object()) bad(path_, "__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) bad(path_, "__metadata__ value '" + m.key() + "' is not a string");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + key + "'";
    if (!v.is_object()) bad(path_, where + ": entry is not an object");
    if (!v.contains("dtype") || !v["dtype"].is_string()) bad(path_, where + ": missing or non-string dtype");
    if (!v.contains("shape") || !v["shape"].is_array()) bad(path_, where + ": missing or non-array shape");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
      bad(path_, where + ": data_offsets must be an array of two integers");
    TensorEntry e;
    e.name = key;
    std::string dt = v["dtype"].get<std::string>();
    if (!dtype_from_name(dt, &e.dtype))
      bad(path_, where + ": unknown dtype '" + dt + "' (supported: F32 F64 BF16 F16 F8_E4M3 I64 I32 I8 U8 BOOL)");
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) bad(path_, where + ": shape entries must be non-negative integers");
      uint64_t x = d.get<uint64_t>();
      if (x != 0 && numel > std::numeric_limits<uint64_t>::max() / x) bad(path_, where + ": shape overflows");
      numel *= x;
      e.shape.push_back(int64_t(x));
    }
    if (numel > (uint64_t(1) << 62) / 8) bad(path_, where + ": shape too large");
    for (const auto& o : v["data_offsets"])
      if (!o.is_number_unsigned()) bad(path_, where + ": data_offsets must be non-negative integers");
    e.begin = v["data_offsets"][0].get<uint64_t>();
    e.end = v["data_offsets"][1].get<uint64_t>();
    if (e.begin > e.end) bad(path_, where + ": data_offsets begin > end");
    if (e.end > data_size_)
      bad(path_, where + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                     ") run past the " + std::to_string(data_size_) + "-byte data section (truncated?)");
    uint64_t expect = numel * dtype_size(e.dtype);
    if (e.end - e.begin != expect)
      bad(path_, where + ": " + std::string(dtype_name(e.dtype)) + shape_str(e.shape) + " needs " +
                     std::to_string(expect) + " bytes but data_offsets span " + std::to_string(e.end - e.begin));
    auto [pos, inserted] = entries_.emplace(key, std::move(e));
    if (!inserted) bad(path_, where + ": duplicate tensor name");
    order.push_back(&pos->second);
  }
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < order.size(); ++i)
    if (order[i]->begin < order[i - 1]->end && order[i]->end > order[i]->begin)
      bad(path_, "tensors '" + order[i - 1]->name + "' and '" + order[i]->name + "' overlap");
}

std::vector<std::string> SafeTensors::names() const {
  std::vector<std::string> v;
  for (const auto& [k, e] : entries_) v.push_back(k);
  return v;
}

const TensorEntry& SafeTensors::entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) bad(path_, "no tensor named '" + name + "'");
  return it->second;
}

Tensor SafeTensors::get(const std::string& name) const {
  const TensorEntry& e = entry(name);
  const char* p = data_ + e.begin;
  size_t align = dtype_size(e.dtype);
  Tensor view = Tensor::external(const_cast<char*>(p), e.shape, e.dtype, std::shared_ptr<void>(base_, nullptr));
  if (reinterpret_cast<uintptr_t>(p) % align != 0) {
    Tensor copy = Tensor::empty(e.shape, e.dtype);
    if (copy.nbytes()) std::memcpy(copy.raw(), p, copy.nbytes());
    return copy;
  }
  return view;
}

Tensor SafeTensors::get_f32(const std::string& name) const {
  Tensor t = get(name);
  return t.dtype() == DType::F32 ? t : t.to(DType::F32);
}

// ---------------------------------------------------------------------------------------------

Checkpoint Checkpoint::open(const std::string& path) {
  Checkpoint c;
  c.path_ = path;
  std::error_code ec;
  if (!fs::exists(path, ec)) throw error("checkpoint", path, ": no such file or folder");
  std::vector<std::string> files;
  if (fs::is_directory(path, ec)) {
    fs::path index = fs::path(path) / "model.safetensors.index.json";
    fs::path single = fs::path(path) / "model.safetensors";
    if (fs::exists(index)) {
      json j;
      try {
        std::ifstream in(index);
        j = json::parse(in);
      } catch (const json::exception& e) {
        throw error("checkpoint", index.string(), ": not valid JSON: ", e.what());
      }
      if (!j.contains("weight_map") || !j["weight_map"].is_object())
        throw error("checkpoint", index.string(), ": missing 'weight_map' object");
      std::map<std::string, size_t> file_index;
      std::map<std::string, std::string> wanted;
      for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
        if (!it.value().is_string())
          throw error("checkpoint", index.string(), ": weight_map['", it.key(), "'] is not a file name");
        std::string f = it.value().get<std::string>();
        if (f.find('/') != std::string::npos || f == ".." )
          throw error("checkpoint", index.string(), ": shard name '", f, "' must be a plain file name");
        wanted[it.key()] = f;
        if (!file_index.count(f)) {
          file_index[f] = c.files_.size();
          c.files_.push_back(SafeTensors::open((fs::path(path) / f).string()));
        }
      }
      for (const auto& [name, f] : wanted) {
        const SafeTensors& s = c.files_[file_index[f]];
        if (!s.has(name))
          throw error("checkpoint", index.string(), ": weight_map says '", name, "' is in ", f, " but it is not");
        c.where_[name] = file_index[f];
      }
      return c;
    }
    if (!fs::exists(single))
      throw error("checkpoint", path, ": no model.safetensors or model.safetensors.index.json in this folder");
    files.push_back(single.string());
  } else {
    files.push_back(path);
  }
  for (const auto& f : files) {
    c.files_.push_back(SafeTensors::open(f));
    for (const auto& n : c.files_.back().names()) c.where_[n] = c.files_.size() - 1;
  }
  return c;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> v;
  for (const auto& [k, i] : where_) v.push_back(k);
  return v;
}

const TensorEntry& Checkpoint::entry(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) throw error("checkpoint", path_, ": missing tensor '", name, "'");
  return files_[it->second].entry(name);
}

Tensor Checkpoint::get(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) throw error("checkpoint", path_, ": missing tensor '", name, "'");
  return files_[it->second].get(name);
}

Tensor Checkpoint::get_f32(const std::string& name) const {
  Tensor t = get(name);
  return t.dtype() == DType::F32 ? t : t.to(DType::F32);
}

// ---------------------------------------------------------------------------------------------

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<std::pair<std::string, Tensor>> sorted = tensors;
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t off = 0;
  for (auto& [name, t] : sorted) {
    K3_CHECK(t.has_storage(), "save_safetensors: tensor '", name, "' has no storage");
    if (!t.is_contiguous()) t = t.clone();
    if (h.contains(name)) throw error("safetensors", path, ": duplicate tensor name '", name, "'");
    h[name] = {{"dtype", std::string(dtype_name(t.dtype()))}, {"shape", t.shape()}, {"data_offsets", {off, off + t.nbytes()}}};
    off += t.nbytes();
  }
  std::string header = h.dump();
  while ((header.size() + 8) % 8 != 0) header.push_back(' ');  // keep the data 8-byte aligned
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw error("safetensors", "cannot write ", tmp, ": ", std::strerror(errno));
    uint64_t n = header.size();
    char len[8];
    for (int i = 0; i < 8; ++i) len[i] = char((n >> (8 * i)) & 0xff);
    out.write(len, 8);
    out.write(header.data(), std::streamsize(header.size()));
    for (const auto& [name, t] : sorted)
      if (t.nbytes()) out.write(static_cast<const char*>(t.raw()), std::streamsize(t.nbytes()));
    out.flush();
    if (!out) {
      out.close();
      std::error_code rm;
      fs::remove(tmp, rm);  // leave nothing half-written behind
      throw error("safetensors", "write failed for ", tmp, " (disk full?)");
    }
  }
  int fd = ::open(tmp.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp);
    throw error("safetensors", "cannot move ", tmp, " to ", path, ": ", ec.message());
  }
}

}  // namespace k3
