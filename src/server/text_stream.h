// A request's token stream as text: the tokenizer's streaming decoder, the end-of-text token and
// the other special tokens hidden (but those the chat output parses: tool-call and reasoning
// markers), and stop strings found across token boundaries (text that may begin a stop string is
// held back until it cannot).
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "tokenizer/bpe.h"

namespace k3::serve {

// Holds back text that may be the start of a stop string; reports a stop string once seen.
class StopScanner {
 public:
  explicit StopScanner(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  std::string push(const std::string& s, bool& hit) {
    held_ += s;
    size_t best = std::string::npos;
    for (const auto& st : stops_) best = std::min(best, held_.find(st));
    if (best != std::string::npos) {
      hit = true;
      std::string out = held_.substr(0, best);
      held_.clear();
      return out;
    }
    size_t keep = 0;
    for (const auto& st : stops_)
      for (size_t k = std::min(st.size() - 1, held_.size()); k > keep; --k)
        if (held_.compare(held_.size() - k, k, st, 0, k) == 0) {
          keep = k;
          break;
        }
    std::string out = held_.substr(0, held_.size() - keep);
    held_.erase(0, held_.size() - keep);
    return out;
  }
  std::string flush() { return std::exchange(held_, std::string()); }

 private:
  std::vector<std::string> stops_;
  std::string held_;
};

// Turns a request's token stream into text: tokenizer (if any), EOS hidden, stop strings.
struct TextAssembler {
  // hidden: special tokens whose text is left out (shared by the requests of a server).
  TextAssembler(const Tokenizer* t, std::optional<int64_t> eos, bool ignore_eos, std::vector<std::string> stops,
                std::shared_ptr<const std::unordered_set<int64_t>> hidden = nullptr)
      : tok(t), eos_id(eos), show_eos(ignore_eos), scan(std::move(stops)), hide(std::move(hidden)) {
    if (tok) dec.emplace(*tok);
  }
  // The special tokens of `tok` but those whose texts are in `shown`.
  static std::shared_ptr<const std::unordered_set<int64_t>> hidden_specials(const Tokenizer& tok,
                                                                            const std::vector<std::string>& shown) {
    auto out = std::make_shared<std::unordered_set<int64_t>>();
    for (const auto& s : tok.specials())
      if (std::find(shown.begin(), shown.end(), s.text) == shown.end()) out->insert(s.id);
    return out;
  }
  // Text ready to send for one token; sets stop_hit when a stop string completed.
  std::string push(int64_t id) {
    if (!dec || stop_hit) return {};
    if (eos_id && id == *eos_id && !show_eos) return {};
    if (hide && hide->count(id) && !(eos_id && id == *eos_id)) return {};
    std::string s;
    try {
      s = dec->push(int32_t(id));
    } catch (const std::exception&) {  // an id the tokenizer has no bytes for
      s.clear();
    }
    return scan.push(s, stop_hit);
  }
  std::string finish() {
    if (!dec || stop_hit) return {};
    std::string s;
    try {
      s = dec->flush();
    } catch (const std::exception&) {
    }
    bool hit = false;
    std::string out = scan.push(s, hit);
    if (hit) stop_hit = true;
    else out += scan.flush();
    return out;
  }
  const Tokenizer* tok;
  std::optional<int64_t> eos_id;
  bool show_eos;
  std::optional<StreamDecoder> dec;
  StopScanner scan;
  std::shared_ptr<const std::unordered_set<int64_t>> hide;
  bool stop_hit = false;
};

}  // namespace k3::serve
