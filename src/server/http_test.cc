// The HTTP layer: the request parser against RFC 9112's framing rules, and a live server on
// loopback against the clients that used to stall it (slow heads and bodies, declared huge
// bodies, floods of idle connections, oversized headers) and the ones it must serve (keep-alive,
// pipelining, chunked bodies both ways, 100-continue).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "server/http.h"

namespace k3::http {
namespace {

Limits small_limits() {
  Limits l;
  l.max_header_bytes = 4096;
  l.max_body_bytes = 1 << 16;
  return l;
}

Progress head_of(const std::string& s, Head& h, ParseError& e, Limits l = small_limits()) {
  return parse_head(s, l, h, e);
}

TEST(HttpParse, HeadArrivesInPieces) {
  const std::string req = "\r\nPOST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nX-Y:  z \r\n\r\nhello";
  Head h;
  ParseError e;
  const size_t head_end = req.find("\r\n\r\n") + 4;
  for (size_t n = 0; n < head_end; ++n) ASSERT_EQ(head_of(req.substr(0, n), h, e), Progress::More) << n;
  ASSERT_EQ(head_of(req, h, e), Progress::Done);
  EXPECT_EQ(h.method, "POST");
  EXPECT_EQ(h.path, "/v1/completions");
  EXPECT_EQ(h.query, "x=1");
  EXPECT_EQ(h.size, head_end);
  EXPECT_EQ(h.content_length, 5u);
  ASSERT_NE(h.header("x-y"), nullptr);
  EXPECT_EQ(*h.header("X-Y"), "z");
  EXPECT_TRUE(h.keep_alive);
  std::string body;
  size_t used = 0;
  EXPECT_EQ(parse_body(std::string_view(req).substr(h.size, 4), h, small_limits(), body, used, e), Progress::More);
  ASSERT_EQ(parse_body(std::string_view(req + "GET / HTTP/1.1\r\n").substr(h.size), h, small_limits(), body, used, e),
            Progress::Done);
  EXPECT_EQ(body, "hello");
  EXPECT_EQ(used, 5u);
}

TEST(HttpParse, RefusesBadFramingWithTheRightStatus) {
  struct Case {
    std::string req;
    int status;
  } cases[] = {
      {"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nContent-Length: 12abc\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nContent-Length: 65537\r\n\r\n", 413},
      {"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501},
      {"GET / HTTP/2.0\r\n\r\n", 505},
      {"GET /\r\n\r\n", 400},
      {"GET / HTTP/1.1 extra\r\n\r\n", 400},
      {"G(T / HTTP/1.1\r\n\r\n", 400},
      {"GET nopath HTTP/1.1\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nNoColon\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nA: b\r\n folded\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nExpect: 200-ok\r\n\r\n", 417},
  };
  for (const auto& c : cases) {
    Head h;
    ParseError e;
    EXPECT_EQ(head_of(c.req, h, e), Progress::Error) << c.req;
    EXPECT_EQ(e.status, c.status) << c.req << ": " << e.message;
    EXPECT_FALSE(e.message.empty());
  }
}

TEST(HttpParse, HeadLimitIsEnforcedBeforeTheHeadEnds) {
  Head h;
  ParseError e;
  const std::string big = "GET / HTTP/1.1\r\nX: " + std::string(5000, 'a');
  ASSERT_EQ(head_of(big, h, e), Progress::Error);  // no end in sight, already over
  EXPECT_EQ(e.status, 431);
  ASSERT_EQ(head_of(big + "\r\n\r\n", h, e), Progress::Error);
  EXPECT_EQ(e.status, 431);
  ASSERT_EQ(head_of("GET /" + std::string(20000, 'a'), h, e, Limits{}), Progress::Error);
  EXPECT_EQ(e.status, 414);
}

TEST(HttpParse, KeepAliveFollowsTheVersion) {
  Head h;
  ParseError e;
  ASSERT_EQ(head_of("GET / HTTP/1.0\r\n\r\n", h, e), Progress::Done);
  EXPECT_FALSE(h.keep_alive);
  ASSERT_EQ(head_of("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", h, e), Progress::Done);
  EXPECT_TRUE(h.keep_alive);
  ASSERT_EQ(head_of("GET / HTTP/1.1\r\nConnection: close\r\n\r\n", h, e), Progress::Done);
  EXPECT_FALSE(h.keep_alive);
  ASSERT_EQ(head_of("GET http://host:1/metrics HTTP/1.1\r\n\r\n", h, e), Progress::Done);
  EXPECT_EQ(h.path, "/metrics");
}

TEST(HttpParse, ChunkedBodies) {
  Head h;
  ParseError e;
  ASSERT_EQ(head_of("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", h, e), Progress::Done);
  const std::string wire = "4\r\nWiki\r\n5;ext=1\r\npedia\r\nE\r\n in\r\n\r\nchunks.\r\n0\r\nTrailer: x\r\n\r\nNEXT";
  std::string body;
  size_t used = 0;
  const size_t end = wire.size() - 4;
  for (size_t n = 0; n < end; ++n)
    ASSERT_EQ(parse_body(std::string_view(wire).substr(0, n), h, small_limits(), body, used, e), Progress::More) << n;
  ASSERT_EQ(parse_body(wire, h, small_limits(), body, used, e), Progress::Done) << e.message;
  EXPECT_EQ(body, "Wikipedia in\r\n\r\nchunks.");
  EXPECT_EQ(used, end);
  EXPECT_EQ(parse_body("zz\r\n", h, small_limits(), body, used, e), Progress::Error);
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(parse_body("3\r\nabcdef\r\n", h, small_limits(), body, used, e), Progress::Error);
  EXPECT_EQ(parse_body("10001\r\n", h, small_limits(), body, used, e), Progress::Error);
  EXPECT_EQ(e.status, 413);
}

// ---- a live server on loopback ----

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

int connect_to(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool send_str(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += size_t(n);
  }
  return true;
}

// Reads until `until` appears in what arrived (or the peer closes, or `timeout_s` passes).
std::string read_until(int fd, const std::string& until, double timeout_s = 5) {
  std::string got;
  const auto t0 = std::chrono::steady_clock::now();
  char buf[4096];
  while (got.find(until) == std::string::npos) {
    const double left = timeout_s - seconds_since(t0);
    if (left <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, int(left * 1000) + 1) <= 0) break;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    got.append(buf, size_t(n));
  }
  return got;
}

// One request on a fresh connection; the whole answer (the server closes: Connection: close).
std::string ask(int port, const std::string& req, double timeout_s = 5) {
  const int fd = connect_to(port);
  if (fd < 0) return "";
  send_str(fd, req);
  std::string r = read_until(fd, "\x01never", timeout_s);
  close(fd);
  return r;
}

int status_of(const std::string& response) {
  return response.size() > 12 && response.rfind("HTTP/1.1 ", 0) == 0 ? std::atoi(response.c_str() + 9) : -1;
}

class LiveServer : public ::testing::Test {
 protected:
  void SetUp() override {
    Limits l;
    l.header_timeout_s = 0.6;
    l.body_timeout_s = 0.6;
    l.idle_timeout_s = 30;
    l.max_body_bytes = 1 << 20;
    l.max_header_bytes = 8 << 10;
    l.work_threads = 2;
    l.max_connections = 200;
    srv = std::make_unique<Server>(l);
    srv->route("GET", "/health", Lane::Inline, [](const Request&, Response& r) { r.set_content("ok", "text/plain"); });
    srv->route("POST", "/echo", Lane::Work, [](const Request& q, Response& r) { r.set_content(q.body, "text/plain"); });
    srv->route("GET", "/stream", Lane::Work, [](const Request&, Response& r) {
      auto n = std::make_shared<int>(0);
      r.set_stream("text/event-stream", [n](Sink& s) {
        if (++*n <= 3) return s.write("part" + std::to_string(*n) + ";");
        s.done();
        return true;
      }, [](bool) {});
    });
    srv->route("GET", "/throw", Lane::Work, [](const Request&, Response&) -> void { throw std::runtime_error("boom"); });
    port = srv->bind("127.0.0.1", 0);
    loop = std::thread([this] { srv->run(); });
  }
  void TearDown() override {
    srv->stop();
    loop.join();
  }
  std::unique_ptr<Server> srv;
  std::thread loop;
  int port = 0;
};

TEST_F(LiveServer, KeepAlivePipeliningAndMethods) {
  const int fd = connect_to(port);
  ASSERT_GE(fd, 0);
  // Two pipelined requests in one write, then a third after the answers.
  ASSERT_TRUE(send_str(fd, "POST /echo HTTP/1.1\r\nContent-Length: 3\r\n\r\nabcGET /health HTTP/1.1\r\n\r\n"));
  std::string got = read_until(fd, "\r\n\r\nok");
  EXPECT_EQ(status_of(got), 200);
  EXPECT_NE(got.find("Content-Length: 3\r\n"), std::string::npos);
  EXPECT_LT(got.find("abc"), got.find("\r\n\r\nok")) << got;
  ASSERT_TRUE(send_str(fd, "POST /echo HTTP/1.1\r\nContent-Length: 2\r\nConnection: close\r\n\r\nxy"));
  got = read_until(fd, "\x01never");
  EXPECT_NE(got.find("Connection: close"), std::string::npos);
  EXPECT_EQ(got.substr(got.size() - 2), "xy");
  close(fd);
  const std::string r405 = ask(port, "DELETE /health HTTP/1.1\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(status_of(r405), 405);
  EXPECT_NE(r405.find("Allow: GET"), std::string::npos);
  EXPECT_EQ(status_of(ask(port, "GET /nothing HTTP/1.1\r\nConnection: close\r\n\r\n")), 404);
  EXPECT_EQ(status_of(ask(port, "GET /throw HTTP/1.1\r\nConnection: close\r\n\r\n")), 500);
}

TEST_F(LiveServer, ChunkedBothWaysAndContinue) {
  std::string got = ask(port, "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                              "3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n");
  EXPECT_EQ(status_of(got), 200);
  EXPECT_EQ(got.substr(got.size() - 5), "abcde");
  got = ask(port, "GET /stream HTTP/1.1\r\nConnection: close\r\n\r\n");
  EXPECT_NE(got.find("Transfer-Encoding: chunked"), std::string::npos);
  EXPECT_NE(got.find("6\r\npart1;\r\n6\r\npart2;\r\n6\r\npart3;\r\n0\r\n\r\n"), std::string::npos) << got;
  // HTTP/1.0 gets the stream unframed, ended by the close.
  got = ask(port, "GET /stream HTTP/1.0\r\n\r\n");
  EXPECT_EQ(got.substr(got.size() - 18), "part1;part2;part3;");
  // Expect: 100-continue: the interim answer comes before the body is sent.
  const int fd = connect_to(port);
  ASSERT_TRUE(send_str(fd, "POST /echo HTTP/1.1\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"));
  EXPECT_EQ(read_until(fd, "\r\n\r\n", 2), "HTTP/1.1 100 Continue\r\n\r\n");
  ASSERT_TRUE(send_str(fd, "wxyz"));
  got = read_until(fd, "wxyz");
  EXPECT_EQ(status_of(got), 200);
  close(fd);
}

TEST_F(LiveServer, SlowClientsDoNotStallOthers) {
  // 100 clients that send a head and one byte of a 1,000-byte body, and 50 that send half a head:
  // with 2 worker threads, a blocking server would stall on the first two.
  std::vector<int> slow;
  for (int i = 0; i < 150; ++i) {
    const int fd = connect_to(port);
    ASSERT_GE(fd, 0);
    send_str(fd, i < 100 ? "POST /echo HTTP/1.1\r\nContent-Length: 1000\r\n\r\nx" : "POST /echo HTTP/1.1\r\nContent-Le");
    slow.push_back(fd);
  }
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(status_of(ask(port, "GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")), 200);
  EXPECT_LT(seconds_since(t0), 1.0);
  t0 = std::chrono::steady_clock::now();
  const std::string echo = ask(port, "POST /echo HTTP/1.1\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi");
  EXPECT_EQ(status_of(echo), 200);
  EXPECT_LT(seconds_since(t0), 1.0);
  // A declared body over the limit, or a negative length, is refused at once, body unsent.
  t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(status_of(ask(port, "POST /echo HTTP/1.1\r\nContent-Length: 5000000\r\n\r\n")), 413);
  EXPECT_EQ(status_of(ask(port, "POST /echo HTTP/1.1\r\nContent-Length: -5\r\n\r\n")), 400);
  EXPECT_EQ(status_of(ask(port, "HELLO\r\n\r\n")), 400);
  EXPECT_LT(seconds_since(t0), 1.0);
  // The slow ones get 408 once their phase's deadline passes, and their slots are freed.
  for (int fd : slow) {
    const std::string r = read_until(fd, "\r\n\r\n", 3);
    EXPECT_EQ(status_of(r), 408) << r;
    close(fd);
  }
  EXPECT_GE(srv->counters().timed_out, 150u);
}

TEST_F(LiveServer, AFloodOfIdleConnectionsCannotLockOutNewOnes) {
  // More idle connections than the limit (200, raised to 2 x 2 + 128 = 132 at least): the oldest
  // waiting ones are dropped to make room, so /health still answers.
  std::vector<int> idle;
  for (int i = 0; i < 260; ++i) {
    const int fd = connect_to(port);
    if (fd >= 0) idle.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(status_of(ask(port, "GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")), 200);
  EXPECT_LT(seconds_since(t0), 1.0);
  const auto c = srv->counters();
  EXPECT_GE(c.evicted, 60u);
  EXPECT_LE(c.connections, 200u);
  for (int fd : idle) close(fd);
}

TEST_F(LiveServer, OversizedHeadersAreCutOffAtTheLimit) {
  const int fd = connect_to(port);
  ASSERT_GE(fd, 0);
  std::string head = "GET /health HTTP/1.1\r\nX-Big: ";
  send_str(fd, head);
  // Keep sending: the server answers 431 after 8 KiB and holds no more than its limit.
  size_t sent = 0, max_buffered = 0;
  const std::string block(64 << 10, 'a');
  for (int i = 0; i < 160; ++i) {
    const ssize_t n = send(fd, block.data(), block.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) sent += size_t(n);
    max_buffered = std::max(max_buffered, srv->counters().buffered_bytes);
    if (n < 0 && errno != EAGAIN) break;
  }
  const std::string r = read_until(fd, "\r\n\r\n", 2);
  EXPECT_EQ(status_of(r), 431) << r.substr(0, 200);
  EXPECT_LT(max_buffered, size_t(200 << 10));
  close(fd);
}

}  // namespace
}  // namespace k3::http
