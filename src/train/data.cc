#include "train/data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/random.h"

namespace k3 {

namespace fs = std::filesystem;

std::vector<std::string> list_text_files(const std::vector<std::string>& paths) {
  std::vector<std::string> files;
  for (const auto& p : paths) {
    std::error_code ec;
    if (fs::is_regular_file(p, ec)) {
      files.push_back(p);
    } else if (fs::is_directory(p, ec)) {
      std::vector<std::string> found;
      for (const auto& e : fs::recursive_directory_iterator(p, ec))
        if (e.is_regular_file() && e.path().extension() == ".txt") found.push_back(e.path().string());
      std::sort(found.begin(), found.end());
      if (found.empty()) throw error("data", p, ": folder has no *.txt files");
      files.insert(files.end(), found.begin(), found.end());
    } else {
      throw error("data", p, ": no such file or folder");
    }
  }
  if (files.empty()) throw error("data", "no input files given");
  return files;
}

namespace {
uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::string cache_key(const std::vector<std::string>& files, const Tokenizer& tok, double val_fraction) {
  uint64_t h = fnv1a("k3-tokens-v1");
  for (const auto& f : files) {
    std::error_code ec;
    auto size = fs::file_size(f, ec);
    auto mtime = fs::last_write_time(f, ec).time_since_epoch().count();
    h = fnv1a(fs::absolute(f).string() + "|" + std::to_string(size) + "|" + std::to_string(mtime), h);
  }
  // Fingerprint of the tokenizer: its size and a sample of its tokens.
  h = fnv1a(std::to_string(tok.vocab_size()), h);
  for (int32_t i = 0; i < tok.vocab_size(); i += std::max(1, tok.vocab_size() / 64)) {
    try {
      h = fnv1a(tok.token_bytes(i), h);
    } catch (const Error&) {
    }
  }
  h = fnv1a(std::to_string(val_fraction), h);
  std::ostringstream os;
  os << std::hex << h;
  return os.str();
}
}  // namespace

TokenData TokenData::from_tokens(std::vector<int32_t> tokens, double val_fraction) {
  auto holder = std::make_shared<std::vector<int32_t>>(std::move(tokens));
  TokenData d;
  d.data_ = holder->data();
  d.n_total_ = int64_t(holder->size());
  d.n_train_ = d.n_total_ - int64_t(double(d.n_total_) * val_fraction);
  d.owner_ = holder;
  return d;
}

TokenData TokenData::build(const std::vector<std::string>& paths, const Tokenizer& tok, const std::string& cache_dir,
                           double val_fraction) {
  std::vector<std::string> files = list_text_files(paths);
  fs::create_directories(cache_dir);
  const std::string path = (fs::path(cache_dir) / (cache_key(files, tok, val_fraction) + ".tokens")).string();
  bool cached = fs::exists(path);
  if (!cached) {
    std::vector<int32_t> all;
    auto eos = tok.eos_id();
    for (const auto& f : files) {
      std::ifstream in(f, std::ios::binary);
      if (!in) throw error("data", f, ": cannot read");
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      tok.encode_ordinary_into(text, all);
      if (eos) all.push_back(*eos);
    }
    if (all.size() < 64) throw error("data", "the data has only ", all.size(), " tokens; give more text");
    std::string tmp = path + ".tmp." + std::to_string(::getpid());
    {
      std::ofstream out(tmp, std::ios::binary);
      out.write(reinterpret_cast<const char*>(all.data()), std::streamsize(all.size() * 4));
      if (!out) throw error("data", "cannot write the token cache ", tmp);
    }
    fs::rename(tmp, path);
  }
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw error("data", path, ": cannot open the token cache");
  struct stat st {};
  ::fstat(fd, &st);
  size_t bytes = size_t(st.st_size);
  if (bytes % 4 != 0 || bytes < 256) {
    ::close(fd);
    fs::remove(path);
    throw error("data", path, ": corrupt token cache (removed; run again to rebuild it)");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) throw error("data", path, ": mmap failed");
  TokenData d;
  d.owner_ = std::shared_ptr<const void>(p, [bytes](const void* q) { ::munmap(const_cast<void*>(q), bytes); });
  d.data_ = static_cast<const int32_t*>(p);
  d.n_total_ = int64_t(bytes / 4);
  d.n_train_ = d.n_total_ - int64_t(double(d.n_total_) * val_fraction);
  d.from_cache_ = cached;
  for (int64_t i = 0; i < d.n_total_; ++i)
    if (d.data_[i] < 0 || d.data_[i] >= tok.vocab_size())
      throw error("data", path, ": token ", d.data_[i], " outside the tokenizer's vocabulary (stale cache?)");
  return d;
}

void TokenData::batch(Split s, int64_t B, int64_t T, uint64_t seed, int64_t step, std::vector<int64_t>& ids,
                      std::vector<int64_t>& targets) const {
  const int64_t n = size(s);
  if (n < T + 1) throw error("data", "the ", s == Split::Train ? "train" : "validation", " split has ", n,
                             " tokens, fewer than one sequence of ", T + 1);
  const int32_t* tok = tokens(s);
  Rng rng(seed * 0x9e3779b97f4a7c15ull + uint64_t(step) * 0xbf58476d1ce4e5b9ull + (s == Split::Val ? 7 : 0));
  ids.resize(size_t(B * T));
  targets.resize(size_t(B * T));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t off = int64_t(rng.below(uint64_t(n - T)));
    for (int64_t t = 0; t < T; ++t) {
      ids[size_t(b * T + t)] = tok[off + t];
      targets[size_t(b * T + t)] = tok[off + t + 1];
    }
  }
}

double TokenData::unigram_baseline(int64_t vocab) const {
  std::vector<double> count(size_t(vocab), 0.0);
  for (int64_t i = 0; i < n_train_; ++i) count[size_t(data_[i])] += 1;
  // Add-one smoothing so unseen validation tokens have a finite cost.
  const double total = double(n_train_) + double(vocab);
  double loss = 0;
  const int64_t nv = size(Split::Val);
  const int32_t* val = tokens(Split::Val);
  for (int64_t i = 0; i < nv; ++i) loss -= std::log((count[size_t(val[i])] + 1) / total);
  return nv ? loss / double(nv) : 0.0;
}

}  // namespace k3
