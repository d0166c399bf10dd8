// libFuzzer target for the tokenizer. Each input is
//  1. encoded and decoded with GPT-2's tokenizer: decode(encode(x)) must equal x (also through
//     encode_ordinary and StreamDecoder);
//  2. written to a temporary file and loaded as tokenizer.json, as encoder.json (beside a tiny
//     vocab.bpe) and as vocab.bpe (beside a tiny encoder.json): a k3::Error is fine, anything else
//     (crash, other exception, sanitizer report) is a bug; what loads must round-trip the input too.
// GPT-2 files: $K3_SHARED_DIR/data/gpt2, else the compile definition K3_SHARED_DIR.
//
//   clang++ -std=c++20 -fsanitize=fuzzer,address ...; ./fuzz_tokenizer -max_total_time=30
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"
#include "tokenizer/bpe.h"
#include "tokenizer/byte_level.h"

#ifndef K3_SHARED_DIR
#define K3_SHARED_DIR "../shared"
#endif

namespace {

namespace fs = std::filesystem;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_tokenizer: %s\n", what);
  std::abort();
}

void write_file(const fs::path& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), std::streamsize(data.size()));
  if (!out.flush()) fail("cannot write a temporary file");
}

void check_round_trip(const k3::Tokenizer& tok, const std::string& input) {
  if (tok.decode(tok.encode(input)) != input) fail("decode(encode(x)) != x");
  if (tok.decode(tok.encode_ordinary(input)) != input) fail("decode(encode_ordinary(x)) != x");
}

struct Fixture {
  fs::path dir;
  k3::Tokenizer gpt2;

  static k3::Tokenizer load_gpt2() {
    const char* env = std::getenv("K3_SHARED_DIR");
    const std::string d = std::string(env ? env : K3_SHARED_DIR) + "/data/gpt2";
    return k3::Tokenizer::from_gpt2_files(d + "/encoder.json", d + "/vocab.bpe");
  }

  Fixture() : dir(fs::temp_directory_path() / ("k3_fuzz_tokenizer_" + std::to_string(::getpid()))), gpt2(load_gpt2()) {
    fs::create_directories(dir);
    // A tiny valid pair of GPT-2 files: the 256 bytes, then "Ġt", "he", "Ġthe".
    std::string enc = "{";
    for (int b = 0; b < 256; ++b)
      enc += "\"" + (b == '"' ? std::string("\\\"") : b == '\\' ? std::string("\\\\") : k3::tok::byte_level_encode(std::string(1, char(b)))) +
             "\": " + std::to_string(b) + ", ";
    enc += "\"\xC4\xA0t\": 256, \"he\": 257, \"\xC4\xA0the\": 258, \"<|endoftext|>\": 259}";
    write_file(dir / "tiny_encoder.json", enc);
    write_file(dir / "tiny_vocab.bpe", "#version: 0.2\n\xC4\xA0 t\nh e\n\xC4\xA0t he\n");
    // Both must load, or the fuzzer tests nothing.
    check_round_trip(k3::Tokenizer::from_gpt2_files((dir / "tiny_encoder.json").string(), (dir / "tiny_vocab.bpe").string()),
                     " the then");
  }
  ~Fixture() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

template <class Load>
void try_load(const std::string& input, Load&& load) {
  try {
    const k3::Tokenizer tok = load();
    check_round_trip(tok, input);
  } catch (const k3::Error&) {
    // Malformed files are expected to be rejected with a k3::Error.
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture fx;
  const std::string input(reinterpret_cast<const char*>(data), size);

  check_round_trip(fx.gpt2, input);
  k3::StreamDecoder stream(fx.gpt2);
  std::string streamed;
  for (const int32_t id : fx.gpt2.encode(input)) streamed += stream.push(id);
  if (streamed + stream.flush() != input) fail("StreamDecoder output != input");

  const fs::path file = fx.dir / "input";
  write_file(file, input);
  try_load(input, [&] { return k3::Tokenizer::from_hf_tokenizer_json(file.string()); });
  try_load(input, [&] { return k3::Tokenizer::from_gpt2_files(file.string(), (fx.dir / "tiny_vocab.bpe").string()); });
  try_load(input, [&] { return k3::Tokenizer::from_gpt2_files((fx.dir / "tiny_encoder.json").string(), file.string()); });
  return 0;
}
