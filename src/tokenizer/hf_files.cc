// Tokenizer files: OpenAI's encoder.json + vocab.bpe, Hugging Face's vocab.json + merges.txt and
// tokenizer.json (read and write), and the folder lookup. Everything here turns files into a
// BpeVocab (raw bytes) and hands it to Tokenizer::from_vocab.
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"
#include "tokenizer/bpe.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/split.h"

namespace k3 {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

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

// Calls f(line, line_no) for each line of text (CRLF or LF ends, the ends removed).
template <class F>
void for_each_line(const std::string& text, F&& f) {
  size_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    f(line, line_no);
  }
}

std::vector<MergeText> read_merges_txt(const std::string& path) {
  const std::string text = read_file(path, "merges file");
  std::vector<MergeText> merges;
  for_each_line(text, [&](std::string_view line, size_t line_no) {
    if (line.empty() || (line_no == 1 && line.starts_with("#version"))) return;
    const size_t space = line.find(' ');
    if (space == std::string_view::npos || space == 0 || space + 1 == line.size() ||
        line.find(' ', space + 1) != std::string_view::npos)
      throw error("tokenizer", path, ":", line_no, ": expected a merge \"left right\", got \"",
                  tok::escape_bytes(line), "\"");
    merges.push_back({std::string(line.substr(0, space)), std::string(line.substr(space + 1)),
                      path + ":" + std::to_string(line_no)});
  });
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
    auto pipeline = tok::TextPipeline::from_hf(root.value("normalizer", json()), root.value("pre_tokenizer", json()), path);
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
    BpeVocab v = build_vocab(read_vocab_object(model["vocab"], path), merges, specials, Specials::kListed, path);
    v.pipeline = std::move(pipeline);
    v.listed_merges_only = true;
    v.ignore_merges = model.value("ignore_merges", false);
    return v;
  } catch (const json::exception& e) {  // a field of the wrong JSON type
    throw error("tokenizer", path, ": unexpected tokenizer.json structure (", e.what(), ")");
  }
}

// tiktoken's file: "<base64 bytes> <rank>" per line; the ranks number the tokens from 0. Merges
// for from_vocab: each multi-byte token made from one split of it into two tokens, in rank order
// (under tiktoken's rule any split of a ranked token may merge, so which split is listed does not
// matter).
BpeVocab read_tiktoken(const std::string& path) {
  const std::string text = read_file(path, "tiktoken file");
  BpeVocab v;
  std::unordered_map<std::string, int32_t> ids;
  for_each_line(text, [&](std::string_view line, size_t line_no) {
    if (line.empty()) return;
    const size_t sp = line.find(' ');
    int64_t rank = -1;
    std::string bytes;
    if (sp != std::string_view::npos) {
      try {
        size_t used = 0;
        rank = std::stoll(std::string(line.substr(sp + 1)), &used);
        if (used != line.size() - sp - 1) rank = -1;
      } catch (const std::exception&) {
        rank = -1;
      }
      bytes = tok::base64_decode(line.substr(0, sp));
    }
    if (rank < 0 || rank > INT32_MAX || bytes.empty())
      throw error("tokenizer", path, ":", line_no, ": expected \"<base64 token> <rank>\", got \"",
                  tok::escape_bytes(std::string(line.substr(0, 80))), "\"");
    if (!ids.emplace(bytes, int32_t(rank)).second)
      throw error("tokenizer", path, ":", line_no, ": token ", tok::escape_bytes(bytes), " appears twice");
    v.tokens.emplace_back(bytes, int32_t(rank));
  });
  std::sort(v.tokens.begin(), v.tokens.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  for (const auto& [bytes, id] : v.tokens) {
    if (bytes.size() < 2) continue;
    bool found = false;
    for (size_t k = 1; k < bytes.size() && !found; ++k) {
      const auto l = ids.find(bytes.substr(0, k)), r = ids.find(bytes.substr(k));
      if (l != ids.end() && r != ids.end() && l->second < id && r->second < id) {
        v.merges.emplace_back(l->first, r->first);
        found = true;
      }
    }
    if (!found)
      throw error("tokenizer", path, ": token ", tok::escape_bytes(bytes), " (rank ", id,
                  ") is not two lower-ranked tokens joined; BPE could never make it");
  }
  return v;
}

// A folder's tiktoken.model with what tokenizer_config.json says about it: the special tokens of
// added_tokens_decoder, the rest of the 256 ids after the vocabulary as <|reserved_token_ID|>
// (tokenization_kimi.py's rule), and the split pattern.
BpeVocab read_tiktoken_folder(const std::string& dir, const std::string& path) {
  const std::string cfg_path = (fs::path(dir) / "tokenizer_config.json").string();
  json cfg = json::object();
  if (fs::is_regular_file(cfg_path)) cfg = parse_json(cfg_path, "tokenizer_config.json");
  BpeVocab v = read_tiktoken(path);
  const int32_t n_base = v.tokens.empty() ? 0 : v.tokens.back().second + 1;
  std::map<int64_t, std::string> named;
  if (cfg.contains("added_tokens_decoder") && cfg["added_tokens_decoder"].is_object())
    for (const auto& [key, entry] : cfg["added_tokens_decoder"].items()) {
      int64_t id = -1;
      try {
        id = std::stoll(key);
      } catch (const std::exception&) {
      }
      if (id < n_base || id > INT32_MAX || !entry.is_object() || !entry.contains("content") || !entry["content"].is_string())
        throw error("tokenizer", cfg_path, ": added_tokens_decoder entry \"", key, "\" needs an id after the ", n_base,
                    " ranked tokens and a \"content\" string");
      named[id] = entry["content"].get<std::string>();
    }
  const int64_t last = std::max<int64_t>(n_base + 256, named.empty() ? 0 : named.rbegin()->first + 1);
  for (int64_t id = n_base; id < last; ++id) {
    const auto it = named.find(id);
    v.specials.push_back({it != named.end() ? it->second : "<|reserved_token_" + std::to_string(id) + "|>", int32_t(id)});
  }
  std::string pattern;
  if (cfg.contains("pat_str") && cfg["pat_str"].is_string()) {
    pattern = cfg["pat_str"].get<std::string>();
  } else {
    const std::string c = cfg.dump();
    if (c.find("TikTokenTokenizer") == std::string::npos && c.find("tokenization_kimi") == std::string::npos)
      throw error("tokenizer", path, ": a tiktoken file needs its split pattern: give it as \"pat_str\" in ", cfg_path,
                  " (k3 knows Kimi's, used when tokenizer_config.json names TikTokenTokenizer)");
    pattern = tok::kKimiPattern;
  }
  v.pipeline = tok::TextPipeline::from_pattern(pattern, path);
  return v;
}

}  // namespace

Tokenizer Tokenizer::from_tiktoken_file(const std::string& path, const std::string& pattern,
                                        const std::vector<SpecialToken>& specials) {
  BpeVocab v = read_tiktoken(path);
  v.specials = specials;
  v.pipeline = tok::TextPipeline::from_pattern(pattern, path);
  return from_vocab(v, path);
}

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
  } else if (has("tiktoken.model")) {
    origin = (d / "tiktoken.model").string();
    vocab = read_tiktoken_folder(dir, origin);
  } else {
    throw error("tokenizer", "no tokenizer in ", dir,
                ": looked for tokenizer.json, vocab.json + merges.txt, encoder.json + vocab.bpe, and tiktoken.model");
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
       << added.dump(-1, ' ', false, ojson::error_handler_t::strict) << ",\n  \"normalizer\": "
       << (v.pipeline ? v.pipeline->normalizer_json().dump() : "null") << ",\n"
       << "  \"pre_tokenizer\": " << (v.pipeline ? v.pipeline->pre_tokenizer_json().dump() : byte_level.dump())
       << ",\n  \"post_processor\": null,\n"
       << "  \"decoder\": " << byte_level.dump() << ",\n"
       // ignore_merges: a piece that is a whole token maps to it directly, as in tiktoken.
       << "  \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, "
       << "\"continuing_subword_prefix\": null, \"end_of_word_suffix\": null, \"fuse_unk\": false, "
       << "\"byte_fallback\": false, \"ignore_merges\": "
       << (v.listed_merges_only && !v.ignore_merges ? "false" : "true") << ",\n    \"vocab\": {";
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
