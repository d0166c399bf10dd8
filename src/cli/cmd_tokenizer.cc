// k3 tokenizer: train a byte-level BPE, and encode or decode with any model's tokenizer.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "tokenizer/bpe.h"
#include "tokenizer/bpe_train.h"
#include "train/data.h"

namespace k3::cli {

namespace {

// A model folder, a tokenizer.json, or a tiktoken file (read with its folder's tokenizer_config.json).
Tokenizer load_tokenizer(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) return Tokenizer::from_dir(path);
  if (!fs::is_regular_file(path, ec)) throw error("tokenizer", path, ": no such file or folder");
  if (path.ends_with(".json")) return Tokenizer::from_hf_tokenizer_json(path);
  const fs::path dir = fs::path(path).parent_path();
  if (fs::path(path).filename() == "tiktoken.model") return Tokenizer::from_dir(dir.empty() ? "." : dir.string());
  throw error("tokenizer", path, ": give a model folder, a tokenizer.json, or a folder's tiktoken.model");
}

std::string read_input(const std::string& file) {
  if (file.empty() || file == "-") {
    if (isatty(STDIN_FILENO)) std::cerr << "k3 tokenizer: reading standard input (end with Ctrl-D)\n";
    return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) throw error("tokenizer", "cannot read ", file);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

void register_tokenizer(CLI::App& app) {
  auto* cmd = app.add_subcommand("tokenizer", "Tokenizer tools: train a BPE; encode and decode with a model's tokenizer");
  cmd->require_subcommand(1);
  auto* tr = cmd->add_subcommand("train", "Train a byte-level BPE on text files and save it as an HF tokenizer.json");
  static int32_t vocab = 1024;
  static std::vector<std::string> files;
  static std::string out = "tokenizer.json";
  tr->add_option("--vocab-size", vocab, "Vocabulary size (256 byte tokens + merges + <|endoftext|>)")->capture_default_str()->check(CLI::Range(257, 1 << 20));
  tr->add_option("--output,-o", out, "Where to write tokenizer.json")->capture_default_str();
  tr->add_option("files", files, "Text files or folders of *.txt")->required();
  tr->callback([] {
    std::vector<std::string> texts;
    size_t bytes = 0;
    for (const auto& f : list_text_files(files)) {
      std::ifstream in(f, std::ios::binary);
      texts.emplace_back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      bytes += texts.back().size();
    }
    BpeTrainOptions o;
    o.vocab_size = vocab;
    Tokenizer tok = train_bpe(texts, o);
    tok.save_hf_tokenizer_json(out);
    size_t n = 0;
    for (const auto& t : texts) n += tok.encode_ordinary(t).size();
    std::printf("trained a %d-token BPE on %zu bytes: %zu tokens (%.2f bytes/token) -> %s\n", tok.vocab_size(), bytes, n,
                double(bytes) / double(std::max<size_t>(n, 1)), out.c_str());
  });

  static std::string model, input;
  static bool ordinary = false;
  auto* enc = cmd->add_subcommand("encode", "Text to token ids, printed as a JSON array");
  enc->add_option("--model", model, "A model folder, a tokenizer.json, or a folder's tiktoken.model")->required();
  enc->add_option("--input", input, "Text file (default: standard input)");
  enc->add_flag("--no-special", ordinary, "Encode special tokens' text as ordinary text");
  enc->callback([] {
    const Tokenizer tok = load_tokenizer(model);
    const std::string text = read_input(input);
    const std::vector<int32_t> ids = ordinary ? tok.encode_ordinary(text) : tok.encode(text);
    std::cout << nlohmann::json(ids).dump() << "\n";
  });
  auto* dec = cmd->add_subcommand("decode", "A JSON array of token ids to text (the raw bytes)");
  dec->add_option("--model", model, "A model folder, a tokenizer.json, or a folder's tiktoken.model")->required();
  dec->add_option("--input", input, "File holding the JSON array (default: standard input)");
  dec->callback([] {
    const Tokenizer tok = load_tokenizer(model);
    const std::string text = read_input(input);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw error("tokenizer", "decode wants a JSON array of token ids (", e.what(), ")");
    }
    if (!j.is_array()) throw error("tokenizer", "decode wants a JSON array of token ids, got ", j.dump().substr(0, 80));
    std::vector<int32_t> ids;
    for (const auto& v : j) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= tok.vocab_size())
        throw error("tokenizer", "decode: ", v.dump().substr(0, 40), " is not a token id of this tokenizer (0 to ",
                    tok.vocab_size() - 1, ")");
      ids.push_back(v.get<int32_t>());
    }
    const std::string bytes = tok.decode(ids);
    std::fwrite(bytes.data(), 1, bytes.size(), stdout);
  });
}

}  // namespace k3::cli
