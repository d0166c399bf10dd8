// Tokenizer files: OpenAI's encoder.json + vocab.bpe, Hugging Face's vocab.json + merges.txt and
// tokenizer.json (read and write), and the folder lookup. Everything here turns files into a
// BpeVocab (raw bytes) and hands it to Tokenizer::from_vocab.
#include <unistd.h>

#include <cstdio>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"
#include "tokenizer/bpe.h"
#include "tokenizer/byte_level.h"

namespace k3 {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The GPT-2 pattern as tokenizers' Split pre-tokenizer and tiktoken write it.
constexpr std::string_view kGpt2Patterns[] = {
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
    R"('(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
};

std::string read_file(const std::string& path, std::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw error("tokenizer", "cannot open ", what, " ", path, ": ", std::strerror(errno),
                "; check the path, or point --tokenizer at a model folder");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json parse_json(const std::string& path, std::string_view what) {
  const std::string text = read_file(path, what);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw error("tokenizer", path, " is not valid JSON (", e.what(), "); is the ", what, " truncated?");
  }
}

// The vocabulary of encoder.json / vocab.json / tokenizer.json's model.vocab.
std::unordered_map<std::string, int32_t> read_vocab_object(const json& j, const std::string& path) {
  if (!j.is_object()) throw error("tokenizer", path, ": the vocabulary must be a JSON object {\"token\": id}");
  std::unordered_map<std::string, int32_t> vocab;
  vocab.reserve(j.size());
  for (const auto& [key, value] : j.items()) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() > INT32_MAX)
      throw error("tokenizer", path, ": vocabulary entry \"", tok::escape_bytes(key), "\" has id ", value.dump(),
                  ", expected a non-negative integer");
    vocab.emplace(key, int32_t(value.get<int64_t>()));
  }
  return vocab;
}

struct MergeText {
  std::string left, right, where;  // byte-level strings; "file:line" or "file merges[i]"
};

std::vector<MergeText> read_merges_txt(const std::string& path) {
  const std::string text = read_file(path, "merges file");
  std::vector<MergeText> merges;
  size_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_no == 1 && line.starts_with("#version"))) continue;
    const size_t space = line.find(' ');
    if (space == std::string_view::npos || space == 0 || space + 1 == line.size() ||
        line.find(' ', space + 1) != std::string_view::npos)
      throw error("tokenizer", path, ":", line_no, ": expected a merge \"left right\", got \"",
                  tok::escape_bytes(line), "\"");
    merges.push_back({std::string(line.substr(0, space)), std::string(line.substr(space + 1)),
                      path + ":" + std::to_string(line_no)});
  }
  return merges;
}

// Shared by all formats. `specials` maps special text -> id (from tokenizer.json's added_tokens);
// with `guess_specials`, vocabulary entries that no merge makes and that look like <...> or are not
// byte-level strings become special tokens (vocab.json / encoder.json carry no such list).
enum class Specials { kListed, kGuess };

BpeVocab build_vocab(std::unordered_map<std::string, int32_t> vocab, const std::vector<MergeText>& merges,
                     const std::vector<SpecialToken>& listed, Specials mode, const std::string& vocab_path) {
  BpeVocab out;
  std::unordered_set<std::string> made;  // byte-level strings that some merge produces
  out.merges.reserve(merges.size());
  for (const MergeText& m : merges) {
    for (const std::string* part : {&m.left, &m.right})
      if (!vocab.count(*part))
        throw error("tokenizer", m.where, ": merge \"", m.left, " ", m.right, "\" names \"", *part,
                    "\", which is not in the vocabulary ", vocab_path);
    if (!vocab.count(m.left + m.right))
      throw error("tokenizer", m.where, ": merge \"", m.left, " ", m.right, "\" makes \"", m.left + m.right,
                  "\", which is not in the vocabulary ", vocab_path);
    std::optional<std::string> left = tok::byte_level_decode(m.left), right = tok::byte_level_decode(m.right);
    if (!left || !right)
      throw error("tokenizer", m.where, ": merge \"", tok::escape_bytes(m.left), " ", tok::escape_bytes(m.right),
                  "\" is not made of byte-level strings; only byte-level BPE tokenizers are supported");
    made.insert(m.left + m.right);
    out.merges.emplace_back(std::move(*left), std::move(*right));
  }
  for (const SpecialToken& s : listed) {
    const auto it = vocab.find(s.text);
    if (it != vocab.end() && it->second != s.id)
      throw error("tokenizer", vocab_path, ": added token \"", tok::escape_bytes(s.text), "\" has id ", s.id,
                  " but the vocabulary gives it id ", it->second);
    if (it != vocab.end()) vocab.erase(it);
    out.specials.push_back(s);
  }
  std::unordered_map<int32_t, const SpecialToken*> special_by_id;
  for (const SpecialToken& s : out.specials) special_by_id[s.id] = &s;
  out.tokens.reserve(vocab.size());
  for (auto& [text, id] : vocab) {
    if (const auto it = special_by_id.find(id); it != special_by_id.end())
      throw error("tokenizer", vocab_path, ": vocabulary entry \"", tok::escape_bytes(text), "\" has id ", id,
                  ", which belongs to the added token \"", tok::escape_bytes(it->second->text), "\"");
    std::optional<std::string> bytes = tok::byte_level_decode(text);
    const bool merged = made.count(text) > 0;
    const bool bracketed = text.size() > 2 && text.front() == '<' && text.back() == '>';
    if (mode == Specials::kGuess && !merged && text.size() > 1 && (bracketed || !bytes)) {
      out.specials.push_back({text, id});
      continue;
    }
    if (!bytes)
      throw error("tokenizer", vocab_path, ": vocabulary entry \"", tok::escape_bytes(text), "\" (id ", id,
                  ") is not a byte-level string; only byte-level BPE tokenizers (GPT-2 alphabet) are supported");
    out.tokens.emplace_back(std::move(*bytes), id);
  }
  return out;
}

BpeVocab read_vocab_merges(const std::string& vocab_path, const std::string& merges_path) {
  const json j = parse_json(vocab_path, "vocabulary file");
  return build_vocab(read_vocab_object(j, vocab_path), read_merges_txt(merges_path), {}, Specials::kGuess,
                     vocab_path);
}

std::string describe(const json& j) { return j.is_null() ? "null" : j.dump().substr(0, 200); }

bool is_gpt2_byte_level(const json& pre, const std::string& path, bool inside_sequence) {
  if (!pre.is_object() || !pre.contains("type")) return false;
  const std::string type = pre["type"].get<std::string>();
  if (type == "ByteLevel") {
    if (pre.value("add_prefix_space", false))
      throw error("tokenizer", path, ": pre_tokenizer ByteLevel with add_prefix_space=true is not supported; ",
                  "k3 encodes text exactly as given (set it to false and add the space yourself)");
    return pre.value("use_regex", true) != inside_sequence;
  }
  return false;
}

// Accepts the pre-tokenizers that amount to tiktoken's GPT-2 split: ByteLevel (use_regex), or
// Sequence[Split(GPT-2 pattern, Isolated), ByteLevel(use_regex=false)].
void check_pre_tokenizer(const json& pre, const std::string& path) {
  if (is_gpt2_byte_level(pre, path, false)) return;
  if (pre.is_object() && pre.value("type", "") == "Sequence" && pre.contains("pretokenizers") &&
      pre["pretokenizers"].is_array() && pre["pretokenizers"].size() == 2) {
    const json& split = pre["pretokenizers"][0];
    if (split.value("type", "") == "Split" && split.contains("pattern") && split["pattern"].is_object() &&
        split["pattern"].contains("Regex") && split.value("behavior", "") == "Isolated" &&
        !split.value("invert", false)) {
      const std::string pattern = split["pattern"]["Regex"].get<std::string>();
      bool gpt2 = false;
      for (std::string_view p : kGpt2Patterns) gpt2 = gpt2 || pattern == p;
      if (!gpt2)
        throw error("tokenizer", path, ": pre_tokenizer splits with the regex \"", pattern,
                    "\"; k3 implements only the GPT-2 pattern \"", kGpt2Patterns[0], "\"");
      if (is_gpt2_byte_level(pre["pretokenizers"][1], path, true)) return;
    }
  }
  throw error("tokenizer", path, ": unsupported pre_tokenizer ", describe(pre),
              "; only byte-level BPE with GPT-2's ByteLevel pre-tokenizer is supported");
}

BpeVocab read_tokenizer_json(const std::string& path) {
  const json root = parse_json(path, "tokenizer.json");
  try {
    if (!root.is_object() || !root.contains("model") || !root["model"].is_object())
      throw error("tokenizer", path, ": no \"model\" object; is this a Hugging Face tokenizer.json?");
    const json& model = root["model"];
    const std::string type = model.value("type", "BPE");
    if (type != "BPE")
      throw error("tokenizer", path, ": model type \"", type, "\" is not supported; only byte-level BPE is");
    if (!model.contains("vocab") || !model.contains("merges") || !model["merges"].is_array())
      throw error("tokenizer", path, ": the BPE model needs \"vocab\" and a \"merges\" array");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(key) && !model[key].is_null() && model[key] != "")
        throw error("tokenizer", path, ": BPE option ", key, "=", model[key].dump(), " is not supported");
    if (model.value("byte_fallback", false))
      throw error("tokenizer", path, ": BPE byte_fallback (SentencePiece-style <0xNN> tokens) is not supported; ",
                  "only byte-level BPE is");
    if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() != 0.0)
      throw error("tokenizer", path, ": BPE dropout is not supported");
    if (root.contains("normalizer") && !root["normalizer"].is_null())
      throw error("tokenizer", path, ": normalizer ", describe(root["normalizer"]), " is not supported");
    check_pre_tokenizer(root.value("pre_tokenizer", json()), path);
    if (root.contains("decoder") && !root["decoder"].is_null() && root["decoder"].value("type", "") != "ByteLevel")
      throw error("tokenizer", path, ": decoder ", describe(root["decoder"]),
                  " is not supported; byte-level BPE uses the ByteLevel decoder");

    std::vector<MergeText> merges;
    const json& jm = model["merges"];
    for (size_t i = 0; i < jm.size(); ++i) {
      const std::string where = path + " merges[" + std::to_string(i) + "]";
      if (jm[i].is_string()) {
        const std::string s = jm[i].get<std::string>();
        const size_t space = s.find(' ');
        if (space == std::string::npos || space == 0 || space + 1 == s.size() || s.find(' ', space + 1) != std::string::npos)
          throw error("tokenizer", where, ": expected \"left right\", got \"", tok::escape_bytes(s), "\"");
        merges.push_back({s.substr(0, space), s.substr(space + 1), where});
      } else if (jm[i].is_array() && jm[i].size() == 2 && jm[i][0].is_string() && jm[i][1].is_string()) {
        merges.push_back({jm[i][0].get<std::string>(), jm[i][1].get<std::string>(), where});
      } else {
        throw error("tokenizer", where, ": expected \"left right\" or [\"left\", \"right\"], got ", describe(jm[i]));
      }
    }
    std::vector<SpecialToken> specials;
    if (root.contains("added_tokens") && !root["added_tokens"].is_null()) {
      for (const json& t : root["added_tokens"]) {
        if (!t.is_object() || !t.contains("id") || !t.contains("content") || !t["id"].is_number_integer())
          throw error("tokenizer", path, ": added_tokens entry ", describe(t), " needs \"id\" and \"content\"");
        const int64_t id = t["id"].get<int64_t>();
        if (id < 0 || id > INT32_MAX) throw error("tokenizer", path, ": added token id ", id, " is out of range");
        specials.push_back({t["content"].get<std::string>(), int32_t(id)});
      }
    }
    return build_vocab(read_vocab_object(model["vocab"], path), merges, specials, Specials::kListed, path);
  } catch (const json::exception& e) {  // a field of the wrong JSON type
    throw error("tokenizer", path, ": unexpected tokenizer.json structure (", e.what(), ")");
  }
}

}  // namespace

Tokenizer Tokenizer::from_gpt2_files(const std::string& encoder_json_path, const std::string& vocab_bpe_path) {
  return from_vocab(read_vocab_merges(encoder_json_path, vocab_bpe_path), encoder_json_path + " + " + vocab_bpe_path);
}

Tokenizer Tokenizer::from_hf_vocab_merges(const std::string& vocab_json_path, const std::string& merges_txt_path) {
  return from_vocab(read_vocab_merges(vocab_json_path, merges_txt_path), vocab_json_path + " + " + merges_txt_path);
}

Tokenizer Tokenizer::from_hf_tokenizer_json(const std::string& path) {
  return from_vocab(read_tokenizer_json(path), path);
}

Tokenizer Tokenizer::from_dir(const std::string& dir) {
  const fs::path d(dir);
  std::error_code ec;
  if (!fs::is_directory(d, ec))
    throw error("tokenizer", dir, " is not a folder; from_dir expects a model folder holding tokenizer files");
  auto has = [&](const char* name) { return fs::is_regular_file(d / name, ec); };
  BpeVocab vocab;
  std::string origin;
  if (has("tokenizer.json")) {
    origin = (d / "tokenizer.json").string();
    vocab = read_tokenizer_json(origin);
  } else if (has("vocab.json") && has("merges.txt")) {
    origin = (d / "vocab.json").string() + " + merges.txt";
    vocab = read_vocab_merges((d / "vocab.json").string(), (d / "merges.txt").string());
  } else if (has("encoder.json") && has("vocab.bpe")) {
    origin = (d / "encoder.json").string() + " + vocab.bpe";
    vocab = read_vocab_merges((d / "encoder.json").string(), (d / "vocab.bpe").string());
  } else {
    throw error("tokenizer", "no tokenizer in ", dir,
                ": looked for tokenizer.json, vocab.json + merges.txt, and encoder.json + vocab.bpe");
  }
  if (has("tokenizer_config.json")) {
    const std::string cfg_path = (d / "tokenizer_config.json").string();
    const json cfg = parse_json(cfg_path, "tokenizer_config.json");
    if (cfg.is_object() && cfg.contains("eos_token")) {
      const json& eos = cfg["eos_token"];
      if (eos.is_string()) vocab.eos = eos.get<std::string>();
      else if (eos.is_object() && eos.contains("content") && eos["content"].is_string())
        vocab.eos = eos["content"].get<std::string>();
      else if (!eos.is_null())
        throw error("tokenizer", cfg_path, ": eos_token ", describe(eos), " is neither a string nor {\"content\": ...}");
    }
  }
  return from_vocab(vocab, origin);
}

void Tokenizer::save_hf_tokenizer_json(const std::string& path) const {
  const BpeVocab v = to_vocab();
  using ojson = nlohmann::ordered_json;
  // The small parts go through nlohmann; the vocabulary and merges (tens of thousands of entries)
  // are streamed, because ordered_json's object insert is linear.
  auto quote = [](const std::string& s) { return json(s).dump(-1, ' ', false, json::error_handler_t::strict); };
  ojson added = ojson::array();
  for (const SpecialToken& s : v.specials)
    added.push_back({{"id", s.id}, {"content", s.text}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
  const ojson byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  std::ostringstream os;
  try {
    os << "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n  \"added_tokens\": "
       << added.dump(-1, ' ', false, ojson::error_handler_t::strict) << ",\n  \"normalizer\": null,\n"
       << "  \"pre_tokenizer\": " << byte_level.dump() << ",\n  \"post_processor\": null,\n"
       << "  \"decoder\": " << byte_level.dump() << ",\n"
       // ignore_merges: a piece that is a whole token maps to it directly, as in tiktoken.
       << "  \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, "
       << "\"continuing_subword_prefix\": null, \"end_of_word_suffix\": null, \"fuse_unk\": false, "
       << "\"byte_fallback\": false, \"ignore_merges\": true,\n    \"vocab\": {";
    const char* sep = "\n      ";
    for (const auto& [bytes, id] : v.tokens) {
      os << sep << quote(tok::byte_level_encode(bytes)) << ": " << id;
      sep = ",\n      ";
    }
    // Specials also sit in the model's vocabulary under their own text (as in GPT-2's
    // tokenizer.json), so that tokenizers keeps their ids.
    for (const SpecialToken& s : v.specials) {
      os << sep << quote(s.text) << ": " << s.id;
      sep = ",\n      ";
    }
    os << "\n    },\n    \"merges\": [";
    sep = "\n      ";
    for (const auto& [l, r] : v.merges) {
      os << sep << quote(tok::byte_level_encode(l) + " " + tok::byte_level_encode(r));
      sep = ",\n      ";
    }
    os << "\n    ]\n  }\n}\n";
  } catch (const json::exception& e) {
    throw error("tokenizer", "cannot save ", path, ": a special token is not valid UTF-8 (", e.what(), ")");
  }
  // Written beside and renamed into place: a reader (or a run killed mid-write) never sees half a file.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw error("tokenizer", "cannot write ", tmp, ": ", std::strerror(errno));
    out << os.str();
    if (!out.flush()) {
      const int err = errno;
      out.close();
      std::remove(tmp.c_str());
      throw error("tokenizer", "writing ", path, " failed: ", std::strerror(err));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    throw error("tokenizer", "cannot move ", tmp, " to ", path, ": ", std::strerror(err));
  }
}

}  // namespace k3
