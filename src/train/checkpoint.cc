#include "train/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "core/error.h"

namespace k3 {

namespace fs = std::filesystem;

namespace {

constexpr const char* kLatest = "latest";
constexpr const char* kState = "trainer_state.json";
// The files a checkpoint must hold to be resumed; the run folder links each of them.
constexpr const char* kRequired[] = {"config.json", "model.safetensors", "tokenizer.json", "optimizer.safetensors"};

// The step of a folder named checkpoint-STEP (digits only), or -1.
int64_t checkpoint_step(const std::string& name) {
  const std::string prefix = "checkpoint-";
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size() || name.size() > prefix.size() + 18) return -1;
  int64_t s = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    s = s * 10 + (name[i] - '0');
  }
  return s;
}

void fsync_path(const fs::path& p, bool directory) {
  const int fd = ::open(p.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) throw error("checkpoint", "cannot open ", p.string(), " to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw error("checkpoint", "fsync of ", p.string(), " failed: ", std::strerror(err));
}

// Points LINK at TARGET (relative) by renaming a fresh symlink over it: readers see the old or the
// new target, never neither.
void replace_symlink(const fs::path& link, const std::string& target) {
  const fs::path tmp = link.parent_path() / ("." + link.filename().string() + ".tmp-" + std::to_string(::getpid()));
  std::error_code ec;
  fs::remove(tmp, ec);
  fs::create_symlink(target, tmp, ec);
  if (ec) throw error("checkpoint", "cannot create the link ", tmp.string(), ": ", ec.message());
  fs::rename(tmp, link, ec);
  if (ec) {
    fs::remove(tmp);
    throw error("checkpoint", "cannot replace ", link.string(), ": ", ec.message());
  }
}

std::string read_link_or_empty(const fs::path& link) {
  std::error_code ec;
  if (!fs::is_symlink(fs::symlink_status(link, ec))) return "";
  fs::path t = fs::read_symlink(link, ec);
  return ec ? "" : t.string();
}

void write_file_synced(const fs::path& path, const std::string& text) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw error("checkpoint", "cannot write ", path.string(), " (disk full?)");
  }
  fsync_path(path, false);
}

std::string describe_bytes(uintmax_t n) { return std::to_string(n) + " bytes"; }

}  // namespace

RunDirLock::RunDirLock(const std::string& run_dir) {
  const std::string path = run_dir + "/.lock";
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw error("train", "cannot create ", path, ": ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd_);
    fd_ = -1;
    throw error("train", "another k3 train is writing to ", run_dir, " (", path,
                " is locked); wait for it to finish or pass a different --out");
  }
}

RunDirLock::~RunDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

int remove_stale_temporaries(const std::string& run_dir) {
  int n = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run_dir, ec)) {
    const std::string name = e.path().filename().string();
    const bool ckpt_tmp = name.rfind(".checkpoint-", 0) == 0 && name.find(".tmp-") != std::string::npos;
    const bool link_tmp = name.rfind(".", 0) == 0 && name.find(".tmp-") != std::string::npos;
    const bool file_tmp = name.find(".tmp.") != std::string::npos ||
                          (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0);
    if (!(ckpt_tmp || link_tmp || file_tmp)) continue;
    std::error_code rc;
    fs::remove_all(e.path(), rc);
    if (!rc) ++n;
  }
  return n;
}

std::string latest_checkpoint(const std::string& run_dir) {
  const std::string t = read_link_or_empty(fs::path(run_dir) / kLatest);
  if (t.empty()) return "";
  const fs::path dir = fs::path(run_dir) / t;
  std::error_code ec;
  return fs::is_directory(dir, ec) ? dir.string() : "";
}

std::string file_content_hash(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw error("checkpoint", "cannot read ", path);
  uint64_t h = 1469598103934665603ull;
  constexpr uint64_t prime = 1099511628211ull;
  std::vector<char> buf(size_t(1) << 20);
  while (in) {
    in.read(buf.data(), std::streamsize(buf.size()));
    const size_t got = size_t(in.gcount());
    size_t i = 0;
    for (; i + 8 <= got; i += 8) {
      uint64_t w;
      std::memcpy(&w, buf.data() + i, 8);
      h = (h ^ w) * prime;
      h ^= h >> 29;
    }
    for (; i < got; ++i) h = (h ^ uint8_t(buf[i])) * prime;
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

std::string begin_checkpoint(const std::string& run_dir, int64_t step) {
  const fs::path tmp = fs::path(run_dir) / (".checkpoint-" + std::to_string(step) + ".tmp-" + std::to_string(::getpid()));
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) throw error("checkpoint", "cannot create ", tmp.string(), ": ", ec.message());
  return tmp.string();
}

std::string publish_checkpoint(const std::string& run_dir, const std::string& tmp_dir, int64_t step, Json state,
                               const CheckpointWriteOptions& opt) {
  const fs::path run(run_dir), tmp(tmp_dir);
  // The manifest: every file the checkpoint holds, by size and content.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(tmp))
    if (e.is_regular_file() && e.path().filename() != kState) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  Json files = Json::object();
  for (const auto& n : names) {
    const fs::path p = tmp / n;
    fsync_path(p, false);
    files[n] = {{"bytes", fs::file_size(p)}, {"hash", file_content_hash(p.string())}};
  }
  state["step"] = step;
  state["files"] = files;
  write_file_synced(tmp / kState, state.dump(2) + "\n");
  fsync_path(tmp, true);

  // Rename the complete folder into place. A folder of that name that `latest` does not name is
  // what a save killed before publishing left: complete but never published, so replaced. If
  // `latest` names it (the same step saved again from an earlier checkpoint), the new one is
  // published under a staging name first so that `latest` always names a complete checkpoint.
  const std::string final_name = "checkpoint-" + std::to_string(step);
  const fs::path final_dir = run / final_name;
  const std::string published = read_link_or_empty(run / kLatest);
  std::error_code ec;
  if (fs::exists(final_dir) && published == final_name) {
    const std::string staged = final_name + ".replacing";
    fs::remove_all(run / staged, ec);
    fs::rename(tmp, run / staged);
    fsync_path(run, true);
    replace_symlink(run / kLatest, staged);
    fsync_path(run, true);
    fs::remove_all(final_dir);
    fs::rename(run / staged, final_dir);
  } else {
    if (fs::exists(final_dir)) fs::remove_all(final_dir);
    fs::rename(tmp, final_dir);
  }
  fsync_path(run, true);
  replace_symlink(run / kLatest, final_name);
  // The run folder reads as a model folder: each top-level file is a link through `latest`.
  for (const auto& n : names) {
    const std::string target = std::string(kLatest) + "/" + n;
    if (read_link_or_empty(run / n) != target) replace_symlink(run / n, target);
  }
  if (read_link_or_empty(run / kState) != std::string(kLatest) + "/" + kState)
    replace_symlink(run / kState, std::string(kLatest) + "/" + kState);
  fsync_path(run, true);

  // Prune: keep the newest `keep` checkpoints (the published one among them).
  if (opt.keep > 0) {
    std::vector<std::pair<int64_t, fs::path>> older;
    for (const auto& e : fs::directory_iterator(run)) {
      const std::string name = e.path().filename().string();
      if (name == final_name || !e.is_directory() || e.is_symlink()) continue;
      const int64_t s = checkpoint_step(name);
      const bool staged = name.rfind("checkpoint-", 0) == 0 && name.size() > 10 &&
                          name.compare(name.size() - 10, 10, ".replacing") == 0;
      if (s >= 0) older.emplace_back(s, e.path());
      else if (staged) older.emplace_back(-1, e.path());
    }
    std::sort(older.begin(), older.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    for (size_t i = 0; i < older.size(); ++i)
      if (older[i].first < 0 || int(i) + 1 >= opt.keep) fs::remove_all(older[i].second, ec);
  }
  return final_dir.string();
}

OpenedCheckpoint open_checkpoint(const std::string& path) {
  OpenedCheckpoint c;
  std::error_code ec;
  const fs::path p(path);
  if (!fs::is_directory(p, ec)) throw error("train", "--resume ", path, ": no such folder");
  if (const std::string latest = latest_checkpoint(path); !latest.empty()) {
    c.run_dir = path;
    c.dir = latest;
  } else if (fs::exists(p / kState) && !fs::is_symlink(fs::symlink_status(p / kState))) {
    c.dir = path;
    const fs::path parent = fs::absolute(p).lexically_normal().parent_path();
    const bool in_run = checkpoint_step(fs::absolute(p).lexically_normal().filename().string()) >= 0 ||
                        !read_link_or_empty(parent / kLatest).empty();
    c.run_dir = in_run ? parent.string() : path;
  } else {
    // No published checkpoint: the first save was killed before `latest` was written, or the
    // folder is not a run at all. A complete checkpoint-STEP folder (renamed only once whole)
    // is still usable: take the newest.
    int64_t best = -1;
    for (const auto& e : fs::directory_iterator(p, ec)) {
      const int64_t s = checkpoint_step(e.path().filename().string());
      if (s > best && e.is_directory() && fs::exists(e.path() / kState)) best = s, c.dir = e.path().string();
    }
    if (best < 0)
      throw error("train", "--resume ", path, ": no checkpoint there (no ", kLatest, " link, no ", kState,
                  "); start a new run with --out instead");
    c.run_dir = path;
  }

  const std::string sp = c.dir + "/" + kState;
  c.state = read_json_file(sp);
  if (!c.state.is_object() || !c.state.contains("files") || !c.state["files"].is_object())
    throw error("train", sp,
                " has no manifest of the checkpoint's files, so its model, optimizer and state cannot be shown to "
                "belong to one step (a checkpoint written by an older k3 replaced them one by one, and a kill "
                "between them left them mixed). Its weights still load with --model; start a new run from them "
                "rather than resuming");
  try {
    c.step = c.state.at("step").get<int64_t>();
  } catch (const Json::exception& e) {
    throw error("train", sp, ": no step (", e.what(), ")");
  }
  const Json& files = c.state["files"];
  std::vector<std::string> bad;
  for (const char* need : kRequired)
    if (!files.contains(need)) bad.push_back(std::string(need) + " (not in the manifest)");
  for (const auto& [name, want] : files.items()) {
    const fs::path f = fs::path(c.dir) / name;
    if (!fs::is_regular_file(f, ec)) {
      bad.push_back(name + " (missing)");
      continue;
    }
    uintmax_t bytes = 0;
    std::string want_hash;
    try {
      bytes = want.at("bytes").get<uintmax_t>();
      want_hash = want.at("hash").get<std::string>();
    } catch (const Json::exception&) {
      bad.push_back(name + " (its manifest entry is malformed)");
      continue;
    }
    const uintmax_t have = fs::file_size(f, ec);
    if (have != bytes) {
      bad.push_back(name + " (" + describe_bytes(have) + "; saved with step " + std::to_string(c.step) + ": " +
                    describe_bytes(bytes) + ")");
      continue;
    }
    if (file_content_hash(f.string()) != want_hash)
      bad.push_back(name + " (its content differs from what was saved with step " + std::to_string(c.step) + ")");
  }
  if (!bad.empty()) {
    std::string list;
    for (const auto& b : bad) list += (list.empty() ? "" : ", ") + b;
    throw error("train", "the checkpoint in ", c.dir, " is not one unit: ", list,
                ". Refusing to resume from files of different steps; resume from an intact checkpoint folder");
  }
  return c;
}

}  // namespace k3
