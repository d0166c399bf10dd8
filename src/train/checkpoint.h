// A training run's folder and the checkpoints in it, each written as one unit.
//
//   runs/NAME/
//     checkpoint-40/      config.json model.safetensors tokenizer.json optimizer.safetensors
//                         trainer_state.json (the step, the run's settings, and a manifest:
//                         every other file's size and content hash)
//     latest -> checkpoint-40          the published checkpoint (a symlink, replaced by rename)
//     config.json -> latest/config.json, model.safetensors -> latest/..., ...
//                         so the run folder itself reads as a Hugging Face model folder
//     metrics.jsonl loss.svg .lock
//
// A checkpoint is written into a temporary folder, fsynced, renamed to checkpoint-STEP and then
// published by replacing `latest` with one rename; the previous checkpoint is removed only after
// that. A kill at any point leaves `latest` naming a complete checkpoint. Opening a checkpoint
// verifies every file against the manifest, so a folder whose files come from different steps
// (copied by hand, or written by a version of k3 without manifests) is refused, naming the files.
#pragma once

#include <cstdint>
#include <string>

#include "io/config.h"

namespace k3 {

// Holds an exclusive lock on RUN_DIR/.lock while alive: a second `k3 train` writing the same
// folder is refused instead of interleaving checkpoints.
class RunDirLock {
 public:
  explicit RunDirLock(const std::string& run_dir);
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

 private:
  int fd_ = -1;
};

// Removes what interrupted saves leave in a run folder: checkpoint temporaries and `*.tmp.PID` /
// `*.tmp` files. Returns how many entries went.
int remove_stale_temporaries(const std::string& run_dir);

// The checkpoint folder `latest` names in RUN_DIR, or "" if there is none.
std::string latest_checkpoint(const std::string& run_dir);

struct CheckpointWriteOptions {
  int keep = 1;  // published checkpoints kept (the newest); 0 keeps all
};

// Makes a new, empty temporary folder in RUN_DIR for the checkpoint of STEP and returns it.
std::string begin_checkpoint(const std::string& run_dir, int64_t step);

// Completes the checkpoint in TMP_DIR: writes trainer_state.json (STATE with "step" and the
// manifest of every file in TMP_DIR), fsyncs, renames it to RUN_DIR/checkpoint-STEP, points
// `latest` at it, links the run folder's top-level files, and prunes older checkpoints.
// Returns the published folder.
std::string publish_checkpoint(const std::string& run_dir, const std::string& tmp_dir, int64_t step, Json state,
                               const CheckpointWriteOptions& opt = {});

struct OpenedCheckpoint {
  std::string run_dir;  // where a resumed run writes by default
  std::string dir;      // the checkpoint folder itself
  int64_t step = 0;
  Json state;           // trainer_state.json
};

// Opens PATH for resuming: a run folder (its `latest`) or a checkpoint folder. Verifies that
// every file the manifest lists is present with its size and hash, and that the model,
// optimizer and tokenizer are among them; a k3::Error names the files that do not belong.
OpenedCheckpoint open_checkpoint(const std::string& path);

// 64-bit content hash of a file (FNV-1a over 8-byte words, then the tail's bytes), as hex.
std::string file_content_hash(const std::string& path);

}  // namespace k3
