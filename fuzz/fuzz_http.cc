// Fuzz target: bytes from a client through the HTTP request parser (server/http.h), whole and
// split at every position the first byte picks, as they would arrive in pieces. The parser must
// answer More, Done or an error status, never crash or read past what it was given, and agree
// with itself: a split feed ends where the whole one does.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "server/http.h"

namespace {
using namespace k3::http;

// Head then body of `buf`: Done with the bytes used, More, or Error.
Progress parse(std::string_view buf, const Limits& lim, size_t& used, std::string& body) {
  Head h;
  ParseError e;
  Progress p = parse_head(buf, lim, h, e);
  if (p != Progress::Done) {
    if (p == Progress::Error && (e.status < 400 || e.status > 505 || e.message.empty())) std::abort();
    return p;
  }
  if (h.size > buf.size() || h.content_length > lim.max_body_bytes) std::abort();
  size_t consumed = 0;
  p = parse_body(buf.substr(h.size), h, lim, body, consumed, e);
  if (p == Progress::Done) {
    if (consumed > buf.size() - h.size || body.size() > lim.max_body_bytes) std::abort();
    used = h.size + consumed;
  }
  if (p == Progress::Error && (e.status < 400 || e.message.empty())) std::abort();
  return p;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  Limits lim;
  lim.max_header_bytes = 2048;
  lim.max_body_bytes = 4096;
  const std::string_view all(reinterpret_cast<const char*>(data) + 1, size - 1);
  size_t used = 0;
  std::string body;
  const Progress whole = parse(all, lim, used, body);
  // A prefix that parses completely must end where the whole input does.
  const size_t cut = all.empty() ? 0 : data[0] % (all.size() + 1);
  size_t used2 = 0;
  std::string body2;
  if (parse(all.substr(0, cut), lim, used2, body2) == Progress::Done &&
      (whole != Progress::Done || used2 != used || body2 != body))
    std::abort();
  return 0;
}
