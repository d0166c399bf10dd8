// k3's HTTP/1.1 server: one event-loop thread reads every request in full (with deadlines and size
// limits) before any handler sees it, so clients that send slowly, stall, or declare huge bodies
// cost a connection slot and a bounded buffer, never a worker thread. Complete requests go to a
// lane: Inline handlers (trivial, such as /health) run on the loop itself and are always
// answerable; Control handlers (/metrics) have their own small pool; Work handlers (generation)
// have the large one. Connections are bounded; when all slots are taken, the oldest connection not
// being served is dropped to make room, so a flood of idle or trickling clients cannot lock out
// new ones. Keep-alive, pipelining, chunked request bodies, `Expect: 100-continue`, and chunked
// (streamed) responses are supported; TLS is not (put a proxy in front).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace k3::http {

struct Header {
  std::string name, value;
};

// Bounds on a request and on the connections. Every phase has a deadline.
struct Limits {
  size_t max_header_bytes = 64 << 10;  // request line + headers
  size_t max_body_bytes = 8 << 20;
  size_t max_buffered_bytes = 512u << 20;  // request bytes held across all connections
  size_t max_connections = 4096;
  double header_timeout_s = 10;  // from a request's first byte to the end of its headers
  double body_timeout_s = 30;    // from the end of the headers to the end of the body
  double idle_timeout_s = 60;    // a kept-alive connection waiting for its next request
  double write_timeout_s = 30;   // a response the client does not read
  int work_threads = 64;         // Work lane; as many again may wait in its queue
  int control_threads = 2;       // Control lane
};

// A parsed request line and header block.
struct Head {
  std::string method, target, path, query;
  int minor_version = 1;  // HTTP/1.x
  std::vector<Header> headers;
  bool keep_alive = true;
  bool expect_continue = false;
  bool chunked = false;
  uint64_t content_length = 0;
  size_t size = 0;  // bytes of the head, its blank line included
  const std::string* header(std::string_view name) const;  // case-insensitive; the first; null if absent
};

struct Request : Head {
  std::string body;
  std::string remote_addr;
  int remote_port = 0;
  int fd = -1;  // the connection's socket while the handler runs
  // True once the client has closed or reset the connection (reads nothing, so a pipelined next
  // request stays queued). A handler that computes for long checks it to stop early.
  bool client_gone() const;
};

// Where a streamed response's bytes go. write() is false once the client is gone.
class Sink {
 public:
  virtual ~Sink() = default;
  virtual bool write(std::string_view data) = 0;
  virtual void done() = 0;  // the body is complete
  // True once the client has closed or reset the connection (a write may still succeed then).
  virtual bool client_gone() const = 0;
};

struct Response {
  int status = 200;
  std::vector<Header> headers;
  std::string body, content_type = "text/plain";
  // A streamed body: `stream` is called again and again until it calls sink.done() (it returns
  // false to abandon the response); `stream_end(complete)` runs once after, whatever happened.
  std::function<bool(Sink&)> stream;
  std::function<void(bool)> stream_end;

  void set_content(std::string b, std::string type) { body = std::move(b), content_type = std::move(type); }
  void set_header(std::string name, std::string value) { headers.push_back({std::move(name), std::move(value)}); }
  void set_stream(std::string type, std::function<bool(Sink&)> s, std::function<void(bool)> end) {
    content_type = std::move(type), stream = std::move(s), stream_end = std::move(end);
  }
};

// The result of parsing what has arrived so far.
enum class Progress { More, Done, Error };
struct ParseError {
  int status = 400;
  std::string message;
};

// The head at the start of `buf` (leading blank lines skipped, counted in Head::size).
Progress parse_head(std::string_view buf, const Limits& lim, Head& head, ParseError& err);
// The body that follows a head, from `buf` (the bytes after the head): Content-Length or chunked.
// `consumed` is how many bytes of `buf` the body took (the rest is a pipelined next request).
Progress parse_body(std::string_view buf, const Head& head, const Limits& lim, std::string& body, size_t& consumed,
                    ParseError& err);
const char* status_text(int status);
// The bytes of a response's status line and headers (and its body unless streamed).
std::string serialize_head(const Response& res, bool keep_alive, bool chunked);

enum class Lane { Inline, Control, Work };
using Handler = std::function<void(const Request&, Response&)>;

class Server {
 public:
  explicit Server(Limits lim = {});
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  void route(const std::string& method, const std::string& path, Lane lane, Handler h);
  // Fills the response of an error the HTTP layer found (malformed request, no such path, wrong
  // method, too large, too slow, overloaded); the default is a plain-text body.
  void on_error(std::function<void(int status, const std::string& message, Response&)> f);
  // Called with the status of every response sent (metrics).
  void on_status(std::function<void(int status)> f);

  // Binds host:port (port 0: any free one) and returns the port. Throws on failure.
  int bind(const std::string& host, int port);
  // Serves until stop(); then stops accepting, lets requests being served finish, and returns.
  void run();
  void stop();  // from any thread

  struct Counters {
    size_t connections = 0, busy = 0, buffered_bytes = 0;
    uint64_t accepted = 0, evicted = 0, timed_out = 0, refused = 0;
  };
  Counters counters() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace k3::http
