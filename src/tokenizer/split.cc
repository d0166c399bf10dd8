#include "tokenizer/split.h"

#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/uregex.h>
#include <unicode/utext.h>

#include <atomic>
#include <unordered_map>

#include "core/error.h"
#include "tokenizer/pretokenize.h"

namespace k3::tok {

const char* const kKimiPattern =
    R"([\p{Han}]+)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+)"
    R"(|\s+(?!\S))"
    R"(|\s+)";

namespace {

using Json = nlohmann::json;

// GPT-2's pattern as tokenizers' Split pre-tokenizer and tiktoken write it: these take the
// hand-written matcher.
constexpr std::string_view kGpt2Patterns[] = {
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
    R"('(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
};

std::string describe(const Json& j) { return j.is_null() ? "null" : j.dump().substr(0, 200); }

// \s and \S as Oniguruma and Rust's regex read them (the White_Space property); ICU's own \s is
// [\t\n\f\r\p{Z}], which lacks U+000B and U+0085.
std::string translate(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 32);
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] == '\\' && i + 1 < p.size()) {
      const char c = p[i + 1];
      if (c == 's') out += R"(\p{White_Space})";
      else if (c == 'S') out += R"(\P{White_Space})";
      else out += p.substr(i, 2);
      ++i;
      continue;
    }
    out += p[i];
  }
  return out;
}

std::atomic<uint64_t> next_regex_uid{1};

// One clone of each regex per thread (ICU's matchers hold state), closed when the thread ends.
struct ThreadClones {
  std::unordered_map<uint64_t, URegularExpression*> map;
  ~ThreadClones() {
    for (auto& [uid, re] : map) uregex_close(re);
  }
};

bool is_numeric(uint32_t cp) {  // Rust's char::is_numeric: Nd, Nl, No
  const int8_t t = u_charType(UChar32(cp));
  return t == U_DECIMAL_DIGIT_NUMBER || t == U_LETTER_NUMBER || t == U_OTHER_NUMBER;
}

struct Part {
  size_t begin, end;
  bool match;
};

// The parts of [b, e) after a split with `behavior` (tokenizers' SplitDelimiterBehavior).
void emit(const std::vector<Part>& parts, SplitBehavior behavior, std::vector<std::pair<size_t, size_t>>& out) {
  const size_t first = out.size();
  bool prev_match = false;
  switch (behavior) {
    case SplitBehavior::Removed:
      for (const Part& p : parts)
        if (!p.match) out.emplace_back(p.begin, p.end);
      return;
    case SplitBehavior::Isolated:
      for (const Part& p : parts) out.emplace_back(p.begin, p.end);
      return;
    case SplitBehavior::MergedWithPrevious:
      for (const Part& p : parts) {
        if (p.match && !prev_match && out.size() > first) out.back().second = p.end;
        else out.emplace_back(p.begin, p.end);
        prev_match = p.match;
      }
      return;
    case SplitBehavior::MergedWithNext: {
      std::vector<std::pair<size_t, size_t>> rev;
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->match && !prev_match && !rev.empty()) rev.back().first = it->begin;
        else rev.emplace_back(it->begin, it->end);
        prev_match = it->match;
      }
      out.insert(out.end(), rev.rbegin(), rev.rend());
      return;
    }
    case SplitBehavior::Contiguous:
      for (const Part& p : parts) {
        if (p.match && prev_match && out.size() > first) out.back().second = p.end;
        else out.emplace_back(p.begin, p.end);
        prev_match = p.match;
      }
      return;
  }
}

// Parts of [b, e) from sorted match spans relative to b: the gaps and the matches, in order.
std::vector<Part> parts_of(size_t b, size_t e, const std::vector<std::pair<size_t, size_t>>& matches, bool invert) {
  std::vector<Part> parts;
  size_t pos = b;
  for (const auto& [mb, me] : matches) {
    if (b + mb > pos) parts.push_back({pos, b + mb, invert});
    parts.push_back({b + mb, b + me, !invert});
    pos = b + me;
  }
  if (pos < e) parts.push_back({pos, e, invert});
  return parts;
}

SplitBehavior behavior_of(const Json& j, const std::string& where) {
  const std::string b = j.value("behavior", "Isolated");
  if (b == "Removed") return SplitBehavior::Removed;
  if (b == "Isolated") return SplitBehavior::Isolated;
  if (b == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (b == "Contiguous") return SplitBehavior::Contiguous;
  throw error("tokenizer", where, ": Split behavior \"", b, "\" is not one of Removed, Isolated, MergedWithPrevious, ",
              "MergedWithNext, Contiguous");
}

bool is_gpt2_split(const Json& split) {
  if (split.value("type", "") != "Split" || !split.contains("pattern") || !split["pattern"].is_object() ||
      !split["pattern"].contains("Regex") || split.value("behavior", "") != "Isolated" || split.value("invert", false))
    return false;
  const std::string p = split["pattern"]["Regex"].get<std::string>();
  for (std::string_view g : kGpt2Patterns)
    if (p == g) return true;
  return false;
}

bool is_byte_level(const Json& j, bool use_regex) {
  return j.is_object() && j.value("type", "") == "ByteLevel" && j.value("use_regex", true) == use_regex &&
         !j.value("add_prefix_space", false);
}

}  // namespace

// ---- Regex ------------------------------------------------------------------------------------

struct Regex::Compiled {
  URegularExpression* re = nullptr;
  ~Compiled() {
    if (re) uregex_close(re);
  }
};

Regex::Regex(std::string pattern) : pattern_(std::move(pattern)), compiled_(std::make_unique<Compiled>()),
                                     uid_(next_regex_uid.fetch_add(1)) {
  const std::string icu_pattern = translate(pattern_);
  UErrorCode st = U_ZERO_ERROR;
  UParseError pe{};
  UText ut = UTEXT_INITIALIZER;
  utext_openUTF8(&ut, icu_pattern.data(), int64_t(icu_pattern.size()), &st);
  compiled_->re = uregex_openUText(&ut, 0, &pe, &st);
  utext_close(&ut);
  if (U_FAILURE(st))
    throw error("tokenizer", "the split regex \"", pattern_, "\" does not compile (", u_errorName(st), " at line ",
                pe.line, ", offset ", pe.offset, ")");
}

Regex::~Regex() = default;

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& spans) const {
  thread_local ThreadClones clones;
  URegularExpression*& re = clones.map[uid_];
  UErrorCode st = U_ZERO_ERROR;
  if (!re) {
    re = uregex_clone(compiled_->re, &st);
    // A pattern that backtracks without end (from a hostile file) fails a match instead of
    // hanging: ICU counts in units of about a millisecond, so a match may take some seconds.
    uregex_setTimeLimit(re, 5000, &st);
    if (U_FAILURE(st)) throw error("tokenizer", "cannot clone the split regex: ", u_errorName(st));
  }
  UText ut = UTEXT_INITIALIZER;
  utext_openUTF8(&ut, text.data(), int64_t(text.size()), &st);
  uregex_setUText(re, &ut, &st);
  while (U_SUCCESS(st) && uregex_findNext(re, &st)) {
    const int64_t b = uregex_start64(re, 0, &st), e = uregex_end64(re, 0, &st);
    if (e > b) spans.emplace_back(size_t(b), size_t(e));
  }
  uregex_setText(re, u"", 0, &st);  // drop the reference to `text`
  utext_close(&ut);
  if (U_FAILURE(st))
    throw error("tokenizer", "matching the split regex \"", pattern_, "\" failed: ", u_errorName(st),
                st == U_REGEX_TIME_OUT ? " (the pattern backtracks too much on this text)" : "");
}

// ---- TextPipeline -----------------------------------------------------------------------------

std::shared_ptr<const TextPipeline> TextPipeline::from_hf(const Json& normalizer, const Json& pre,
                                                          const std::string& where) {
  const bool gpt2 = is_byte_level(pre, true) ||
                    (pre.is_object() && pre.value("type", "") == "Sequence" && pre.contains("pretokenizers") &&
                     pre["pretokenizers"].is_array() && pre["pretokenizers"].size() == 2 &&
                     is_gpt2_split(pre["pretokenizers"][0]) && is_byte_level(pre["pretokenizers"][1], false));
  if (normalizer.is_null() && gpt2) return nullptr;
  auto p = std::make_shared<TextPipeline>();
  p->normalizer_json_ = normalizer;
  p->pre_tokenizer_json_ = pre;
  if (!normalizer.is_null()) p->add_norm(normalizer, where);
  if (!pre.is_null()) p->add_pre(pre, where);
  return p;
}

std::shared_ptr<const TextPipeline> TextPipeline::from_pattern(const std::string& pattern, const std::string& where) {
  auto p = std::make_shared<TextPipeline>();
  Step s;
  try {
    s.regex = std::make_shared<Regex>(pattern);
  } catch (const Error& e) {
    throw error("tokenizer", where, ": ", e.what());
  }
  p->steps_.push_back(std::move(s));
  p->pre_tokenizer_json_ = Json{{"type", "Sequence"},
                                {"pretokenizers",
                                 Json::array({Json{{"type", "Split"},
                                                   {"pattern", {{"Regex", pattern}}},
                                                   {"behavior", "Isolated"},
                                                   {"invert", false}},
                                              Json{{"type", "ByteLevel"},
                                                   {"add_prefix_space", false},
                                                   {"trim_offsets", true},
                                                   {"use_regex", false}}})}};
  return p;
}

void TextPipeline::add_norm(const Json& j, const std::string& where) {
  const std::string type = j.is_object() ? j.value("type", "") : "";
  if (type == "Sequence" && j.contains("normalizers") && j["normalizers"].is_array()) {
    for (const Json& n : j["normalizers"]) add_norm(n, where);
  } else if (type == "NFC") norms_.push_back(Norm::NFC);
  else if (type == "NFD") norms_.push_back(Norm::NFD);
  else if (type == "NFKC") norms_.push_back(Norm::NFKC);
  else if (type == "NFKD") norms_.push_back(Norm::NFKD);
  else if (type == "Lowercase") norms_.push_back(Norm::Lowercase);
  else
    throw error("tokenizer", where, ": normalizer ", describe(j),
                " is not supported (k3 reads NFC, NFD, NFKC, NFKD, Lowercase and Sequences of them)");
}

void TextPipeline::add_pre(const Json& j, const std::string& where) {
  const std::string type = j.is_object() ? j.value("type", "") : "";
  Step s;
  if (type == "Sequence" && j.contains("pretokenizers") && j["pretokenizers"].is_array()) {
    for (const Json& n : j["pretokenizers"]) add_pre(n, where);
    return;
  }
  if (type == "Split") {
    if (!j.contains("pattern") || !j["pattern"].is_object())
      throw error("tokenizer", where, ": Split pre-tokenizer without a pattern: ", describe(j));
    const Json& pat = j["pattern"];
    if (pat.contains("Regex")) {
      try {
        s.regex = std::make_shared<Regex>(pat["Regex"].get<std::string>());
      } catch (const Error& e) {
        throw error("tokenizer", where, ": ", e.what());
      }
    } else if (pat.contains("String") && !pat["String"].get<std::string>().empty()) {
      s.literal = pat["String"].get<std::string>();
    } else {
      throw error("tokenizer", where, ": Split pattern ", describe(pat), " is neither {\"Regex\": ...} nor {\"String\": ...}");
    }
    s.behavior = behavior_of(j, where);
    s.invert = j.value("invert", false);
  } else if (type == "Digits") {
    s.kind = Step::Kind::Digits;
    s.individual_digits = j.value("individual_digits", false);
  } else if (type == "ByteLevel") {
    if (j.value("add_prefix_space", false))
      throw error("tokenizer", where, ": pre_tokenizer ByteLevel with add_prefix_space=true is not supported; ",
                  "k3 encodes text exactly as given (set it to false and add the space yourself)");
    if (!j.value("use_regex", true)) return;  // only the byte alphabet, which k3's raw bytes need not
    s.kind = Step::Kind::Gpt2ByteLevel;
  } else if (type == "Whitespace") {  // \w+|[^\w\s]+, the whitespace between dropped
    s.regex = std::make_shared<Regex>(R"(\w+|[^\w\s]+)");
    s.behavior = SplitBehavior::Removed;
    s.invert = true;
  } else if (type == "WhitespaceSplit") {
    s.regex = std::make_shared<Regex>(R"(\s+)");
    s.behavior = SplitBehavior::Removed;
  } else {
    throw error("tokenizer", where, ": pre_tokenizer ", describe(j),
                " is not supported (k3 reads Split, Digits, ByteLevel, Whitespace, WhitespaceSplit and Sequences "
                "of them)");
  }
  steps_.push_back(std::move(s));
}

void TextPipeline::apply(const Step& s, std::string_view text, std::vector<std::pair<size_t, size_t>>& spans) const {
  std::vector<std::pair<size_t, size_t>> out, matches;
  out.reserve(spans.size() * 2);
  for (const auto& [b, e] : spans) {
    const std::string_view piece = text.substr(b, e - b);
    matches.clear();
    switch (s.kind) {
      case Step::Kind::Gpt2ByteLevel: {
        Gpt2Splitter sp(piece);
        while (const auto p = sp.next()) out.emplace_back(b + size_t(p->data() - piece.data()), b + size_t(p->data() - piece.data()) + p->size());
        continue;
      }
      case Step::Kind::Digits: {
        for (size_t pos = 0; pos < piece.size();) {
          uint32_t cp = 0;
          size_t len = utf8_sequence_at(piece, pos, &cp);
          const bool num = len > 0 && is_numeric(cp);
          if (len == 0) len = 1;
          if (num) matches.emplace_back(pos, pos + len);
          pos += len;
        }
        emit(parts_of(b, e, matches, false), s.individual_digits ? SplitBehavior::Isolated : SplitBehavior::Contiguous, out);
        continue;
      }
      case Step::Kind::Split:
        if (s.regex) {
          s.regex->find_all(piece, matches);
        } else {
          for (size_t pos = piece.find(s.literal); pos != std::string_view::npos; pos = piece.find(s.literal, pos + s.literal.size()))
            matches.emplace_back(pos, pos + s.literal.size());
        }
        emit(parts_of(b, e, matches, s.invert), s.behavior, out);
        continue;
    }
  }
  spans.swap(out);
}

void TextPipeline::split(std::string_view text, std::string& storage, std::vector<std::string_view>& pieces) const {
  std::string_view src = text;
  if (!norms_.empty()) {
    icu::UnicodeString u = icu::UnicodeString::fromUTF8(icu::StringPiece(text.data(), int32_t(text.size())));
    for (Norm n : norms_) {
      if (n == Norm::Lowercase) {
        u.toLower(icu::Locale::getRoot());
        continue;
      }
      UErrorCode st = U_ZERO_ERROR;
      const icu::Normalizer2* nz = n == Norm::NFC    ? icu::Normalizer2::getNFCInstance(st)
                                   : n == Norm::NFD  ? icu::Normalizer2::getNFDInstance(st)
                                   : n == Norm::NFKC ? icu::Normalizer2::getNFKCInstance(st)
                                                     : icu::Normalizer2::getNFKDInstance(st);
      if (U_SUCCESS(st)) u = nz->normalize(u, st);
      if (U_FAILURE(st)) throw error("tokenizer", "Unicode normalization failed: ", u_errorName(st));
    }
    storage.clear();
    u.toUTF8String(storage);
    src = storage;
  }
  if (src.empty()) return;
  std::vector<std::pair<size_t, size_t>> spans{{0, src.size()}};
  for (const Step& s : steps_) apply(s, src, spans);
  for (const auto& [b, e] : spans)
    if (e > b) pieces.push_back(src.substr(b, e - b));
}

}  // namespace k3::tok
