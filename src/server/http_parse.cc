// Request parsing for http.h: incremental (called again as bytes arrive), strict where a lenient
// reading could be exploited (conflicting lengths, obsolete line folding, a body length that is not
// a plain decimal number), and bounded before anything is buffered beyond the limits.
#include <algorithm>
#include <cctype>
#include <string>

#include "server/http.h"

namespace k3::http {

namespace {

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) { return std::tolower(uint8_t(x)) == std::tolower(uint8_t(y)); });
}

bool is_tchar(char c) {  // RFC 9110 token characters
  return std::isalnum(uint8_t(c)) || std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

Progress fail(ParseError& err, int status, std::string message) {
  err.status = status;
  err.message = std::move(message);
  return Progress::Error;
}

// The next line of buf from pos (without its CRLF or LF); npos when no line end has arrived.
size_t line_end(std::string_view buf, size_t pos, std::string_view& line) {
  const size_t nl = buf.find('\n', pos);
  if (nl == std::string_view::npos) return nl;
  line = buf.substr(pos, nl - pos);
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return nl + 1;
}

// A decimal (or hex) number of at most 15 digits (below 2^60), nothing else.
bool parse_number(std::string_view s, int base, uint64_t& v) {
  if (s.empty() || s.size() > 15) return false;
  v = 0;
  for (char c : s) {
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (base == 16 && c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else if (base == 16 && c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else return false;
    v = v * uint64_t(base) + uint64_t(d);
  }
  return true;
}

constexpr size_t kMaxRequestLine = 16 << 10;

}  // namespace

const std::string* Head::header(std::string_view name) const {
  for (const Header& h : headers)
    if (iequals(h.name, name)) return &h.value;
  return nullptr;
}

Progress parse_head(std::string_view buf, const Limits& lim, Head& head, ParseError& err) {
  size_t pos = 0;
  while (pos < buf.size() && (buf[pos] == '\r' || buf[pos] == '\n')) ++pos;  // blank lines before it
  if (pos > 64) return fail(err, 400, "blank lines where a request line belongs");
  const size_t window = std::min(buf.size(), pos + lim.max_header_bytes);
  const std::string_view b = buf.substr(0, window);
  std::string_view line;
  size_t next = line_end(b, pos, line);
  if (next == std::string_view::npos) {
    if (b.size() - pos > kMaxRequestLine) return fail(err, 414, "request line over 16 KiB");
    if (buf.size() > window) return fail(err, 431, "request head over " + std::to_string(lim.max_header_bytes) + " bytes");
    return Progress::More;
  }
  // Find the blank line that ends the head before parsing anything more.
  size_t end = next;
  for (std::string_view l;;) {
    const size_t n = line_end(b, end, l);
    if (n == std::string_view::npos) {
      if (buf.size() > window) return fail(err, 431, "request head over " + std::to_string(lim.max_header_bytes) + " bytes");
      return Progress::More;
    }
    end = n;
    if (l.empty()) break;
  }
  head = Head{};
  head.size = end;
  // Request line: METHOD SP target SP HTTP/1.x
  const size_t sp1 = line.find(' '), sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp1 == std::string_view::npos || sp2 == std::string_view::npos || line.find(' ', sp2 + 1) != std::string_view::npos)
    return fail(err, 400, "malformed request line (want METHOD TARGET HTTP/1.1)");
  const std::string_view method = line.substr(0, sp1), target = line.substr(sp1 + 1, sp2 - sp1 - 1),
                         version = line.substr(sp2 + 1);
  if (method.empty() || !std::all_of(method.begin(), method.end(), is_tchar))
    return fail(err, 400, "malformed method in the request line");
  if (version.size() != 8 || version.substr(0, 7) != "HTTP/1." || (version[7] != '0' && version[7] != '1'))
    return version.substr(0, 5) == "HTTP/" ? fail(err, 505, "only HTTP/1.0 and HTTP/1.1 are served")
                                           : fail(err, 400, "malformed HTTP version in the request line");
  if (target.empty() || std::any_of(target.begin(), target.end(), [](char c) { return uint8_t(c) <= 0x20 || c == 0x7f; }))
    return fail(err, 400, "malformed request target");
  head.method = std::string(method);
  head.target = std::string(target);
  head.minor_version = version[7] - '0';
  std::string_view path = target;
  if (path.substr(0, 7) == "http://" || path.substr(0, 8) == "https://") {  // absolute form
    const size_t slash = path.find('/', path.find("//") + 2);
    path = slash == std::string_view::npos ? std::string_view("/") : path.substr(slash);
  }
  if (path.front() != '/' && path != "*") return fail(err, 400, "the request target is not a path");
  const size_t q = path.find('?');
  head.path = std::string(path.substr(0, q));
  if (q != std::string_view::npos) head.query = std::string(path.substr(q + 1));
  // Headers.
  bool have_length = false;
  for (size_t p = next;;) {
    std::string_view l;
    p = line_end(b, p, l);
    if (l.empty()) break;
    if (l.front() == ' ' || l.front() == '\t') return fail(err, 400, "obsolete header line folding");
    const size_t colon = l.find(':');
    if (colon == std::string_view::npos || colon == 0) return fail(err, 400, "malformed header line (no name: value)");
    const std::string_view name = l.substr(0, colon);
    if (!std::all_of(name.begin(), name.end(), is_tchar))
      return fail(err, 400, "malformed header name '" + std::string(name.substr(0, 64)) + "'");
    const std::string_view value = trim(l.substr(colon + 1));
    if (std::any_of(value.begin(), value.end(), [](char c) { return c == '\0' || c == '\r'; }))
      return fail(err, 400, "control character in the value of header " + std::string(name));
    head.headers.push_back({std::string(name), std::string(value)});
    if (iequals(name, "content-length")) {
      uint64_t v = 0;
      if (!parse_number(value, 10, v))
        return fail(err, 400, "Content-Length '" + std::string(value.substr(0, 32)) + "' is not a byte count");
      if (have_length && v != head.content_length) return fail(err, 400, "two different Content-Length headers");
      have_length = true;
      head.content_length = v;
    } else if (iequals(name, "transfer-encoding")) {
      if (!iequals(value, "chunked"))
        return fail(err, 501, "Transfer-Encoding '" + std::string(value.substr(0, 32)) + "' (only chunked is understood)");
      head.chunked = true;
    } else if (iequals(name, "expect")) {
      if (!iequals(value, "100-continue")) return fail(err, 417, "Expect '" + std::string(value.substr(0, 32)) + "'");
      head.expect_continue = true;
    }
  }
  if (head.chunked && have_length) return fail(err, 400, "both Content-Length and Transfer-Encoding: chunked");
  if (head.content_length > lim.max_body_bytes)
    return fail(err, 413, "Content-Length " + std::to_string(head.content_length) + " is over the " +
                              std::to_string(lim.max_body_bytes) + "-byte limit on a request body");
  const std::string* conn = head.header("connection");
  const bool close = conn && iequals(*conn, "close"), keep = conn && iequals(*conn, "keep-alive");
  head.keep_alive = head.minor_version == 1 ? !close : keep;
  return Progress::Done;
}

Progress parse_body(std::string_view buf, const Head& head, const Limits& lim, std::string& body, size_t& consumed,
                    ParseError& err) {
  if (!head.chunked) {
    if (buf.size() < head.content_length) return Progress::More;
    body.assign(buf.substr(0, head.content_length));
    consumed = head.content_length;
    return Progress::Done;
  }
  // Chunked: SIZE[;ext] CRLF DATA CRLF ... 0 CRLF [trailers] CRLF. Re-parsed from the start as bytes
  // arrive (the sizes are few), copied out only once complete.
  size_t pos = 0, total = 0;
  std::vector<std::pair<size_t, size_t>> pieces;
  for (;;) {
    std::string_view l;
    const size_t n = line_end(buf, pos, l);
    if (n == std::string_view::npos) {
      if (buf.size() - pos > 1024) return fail(err, 400, "malformed chunk size line");
      return Progress::More;
    }
    const std::string_view size_s = trim(l.substr(0, l.find(';')));
    uint64_t size = 0;
    if (!parse_number(size_s, 16, size)) return fail(err, 400, "malformed chunk size '" + std::string(size_s.substr(0, 32)) + "'");
    pos = n;
    if (size == 0) break;
    total += size;
    if (total > lim.max_body_bytes)
      return fail(err, 413, "chunked body over the " + std::to_string(lim.max_body_bytes) + "-byte limit on a request body");
    if (buf.size() < pos + size + 2) return Progress::More;
    const std::string_view crlf = buf.substr(pos + size, 2);
    if (crlf != "\r\n" && crlf.front() != '\n') return fail(err, 400, "chunk data longer than its size");
    pieces.emplace_back(pos, size);
    pos += size + (crlf.front() == '\n' ? 1 : 2);
  }
  for (size_t trailers = 0;; ++trailers) {  // trailer lines, ignored, then the blank line
    std::string_view l;
    const size_t n = line_end(buf, pos, l);
    if (n == std::string_view::npos) {
      if (buf.size() - pos > lim.max_header_bytes) return fail(err, 431, "chunked trailers too large");
      return Progress::More;
    }
    pos = n;
    if (l.empty()) break;
    if (trailers > 64) return fail(err, 431, "too many chunked trailer lines");
  }
  body.clear();
  body.reserve(total);
  for (auto [p, s] : pieces) body.append(buf.substr(p, s));
  consumed = pos;
  return Progress::Done;
}

const char* status_text(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 414: return "URI Too Long";
    case 417: return "Expectation Failed";
    case 422: return "Unprocessable Content";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return status < 300 ? "OK" : status < 500 ? "Client Error" : "Server Error";
  }
}

std::string serialize_head(const Response& res, bool keep_alive, bool chunked) {
  std::string s = "HTTP/1.1 " + std::to_string(res.status) + " " + status_text(res.status) + "\r\n";
  s += "Content-Type: " + res.content_type + "\r\n";
  if (chunked) s += "Transfer-Encoding: chunked\r\n";
  else if (!res.stream) s += "Content-Length: " + std::to_string(res.body.size()) + "\r\n";
  s += keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
  for (const Header& h : res.headers) s += h.name + ": " + h.value + "\r\n";
  s += "\r\n";
  if (!res.stream) s += res.body;
  return s;
}

}  // namespace k3::http
