// The connection loop of http.h: one epoll thread owns every connection while it is being read or
// answered by an Inline handler; a complete request moves its connection to a lane's pool, whose
// thread answers it with blocking writes (bounded by the write timeout) and hands the connection
// back for its next request.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "core/error.h"
#include "server/http.h"

namespace k3::http {

namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point after(double s) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

void set_blocking(int fd, bool blocking) {
  const int fl = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, blocking ? (fl & ~O_NONBLOCK) : (fl | O_NONBLOCK));
}

// Blocking send of all of `data` (the socket's send timeout bounds each wait). False on failure.
bool send_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data.remove_prefix(size_t(n));
  }
  return true;
}

// A fixed pool of threads running queued tasks; refuses more than `max_pending` waiting.
class Pool {
 public:
  Pool(int threads, size_t max_pending) : max_pending_(max_pending) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { loop(); });
  }
  ~Pool() { join(); }
  bool submit(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (tasks_.size() >= max_pending_ + size_t(idle_)) return false;
      tasks_.push_back(std::move(f));
    }
    cv_.notify_one();
    return true;
  }
  void join() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
    threads_.clear();
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> f;
      {
        std::unique_lock<std::mutex> l(mu_);
        ++idle_;
        cv_.wait(l, [&] { return stop_ || !tasks_.empty(); });
        --idle_;
        if (tasks_.empty()) return;  // stopping, and nothing left to run
        f = std::move(tasks_.front());
        tasks_.pop_front();
      }
      f();
    }
  }
  size_t max_pending_;
  int idle_ = 0;
  bool stop_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  std::vector<std::thread> threads_;
};

struct Route {
  std::string method;
  Lane lane;
  Handler handler;
};

}  // namespace

namespace {
bool peer_closed(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, POLLRDHUP, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}
}  // namespace

bool Request::client_gone() const { return peer_closed(fd); }

struct Server::Impl {
  // Idle: between requests. Head, Body: a request arriving. Busy: on a lane's thread. Write: the
  // loop writing an answer. Linger: answered and half-closed, reading what the client still sends
  // until it closes (closing with unread bytes would reset the connection and could lose the
  // answer before the client reads it).
  enum class State { Idle, Head, Body, Busy, Write, Linger };
  struct Conn {
    int fd = -1;
    State state = State::Idle;
    std::string in, out;  // bytes read and not yet consumed; an answer being written by the loop
    size_t out_off = 0;
    Head head;
    bool fresh = true;           // no request finished on it yet
    bool close_after = false;    // close once `out` is written
    bool close_on_return = false;  // set by a lane's thread: the connection ends
    size_t reserved = 0;         // bytes counted against max_buffered_bytes
    Clock::time_point deadline, since;
    std::string addr;
    int port = 0;
  };

  explicit Impl(Limits l)
      : lim(l),
        work(std::max(1, l.work_threads), size_t(std::max(1, l.work_threads))),
        control(std::max(1, l.control_threads), 64) {
    if (lim.max_connections < size_t(2 * lim.work_threads + 64 + 64)) lim.max_connections = size_t(2 * lim.work_threads + 128);
  }

  Limits lim;
  std::map<std::string, std::vector<Route>> routes;
  std::function<void(int, const std::string&, Response&)> error_fn;
  std::function<void(int)> status_fn;
  int listen_fd = -1, ep = -1, wake = -1;
  int spare = ::open("/dev/null", O_RDONLY | O_CLOEXEC);  // a descriptor kept for EMFILE
  std::atomic<bool> stopping{false};
  std::unordered_map<int, std::unique_ptr<Conn>> conns;
  std::mutex returned_mu;
  std::vector<Conn*> returned;  // connections lanes have finished with
  mutable std::mutex counters_mu;
  Counters counts;
  size_t buffered = 0, busy = 0;
  Pool work, control;

  void count(int status) {
    if (status_fn) status_fn(status);
  }

  Response error_response(int status, const std::string& message) {
    Response r;
    r.status = status;
    if (error_fn) error_fn(status, message, r);
    else r.set_content(message + "\n", "text/plain");
    r.status = status;
    return r;
  }

  void publish() {
    std::lock_guard<std::mutex> l(counters_mu);
    counts.connections = conns.size();
    counts.busy = busy;
    counts.buffered_bytes = buffered;
  }

  void watch(Conn& c, uint32_t events, int op) {
    epoll_event ev{};
    ev.events = events;
    ev.data.fd = c.fd;
    epoll_ctl(ep, op, c.fd, &ev);
  }

  void release(Conn& c) {
    buffered -= c.reserved;
    c.reserved = 0;
  }

  void close_conn(int fd) {
    auto it = conns.find(fd);
    if (it == conns.end()) return;
    release(*it->second);
    epoll_ctl(ep, EPOLL_CTL_DEL, fd, nullptr);
    ::close(fd);
    conns.erase(it);
  }

  // Answers from the loop: queues the bytes and writes what the socket takes now.
  void answer(Conn& c, const Response& r, bool keep_alive) {
    count(r.status);
    c.out = serialize_head(r, keep_alive, false);
    c.out_off = 0;
    c.close_after = !keep_alive;
    c.state = State::Write;
    c.deadline = after(lim.write_timeout_s);
    flush(c);
  }

  // An HTTP-layer error: answered, then the connection is closed (its framing is unknown).
  void refuse(Conn& c, int status, const std::string& message) {
    answer(c, error_response(status, message), false);
  }

  void flush(Conn& c) {
    while (c.out_off < c.out.size()) {
      const ssize_t n = ::send(c.fd, c.out.data() + c.out_off, c.out.size() - c.out_off, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        watch(c, EPOLLOUT | EPOLLRDHUP, EPOLL_CTL_MOD);
        return;
      }
      if (n <= 0) return close_conn(c.fd);
      c.out_off += size_t(n);
    }
    c.out.clear();
    c.out_off = 0;
    if (c.close_after) return linger(c);
    to_idle(c);
  }

  void linger(Conn& c) {
    shutdown(c.fd, SHUT_WR);
    release(c);
    c.in.clear();
    c.in.shrink_to_fit();
    c.state = State::Linger;
    c.deadline = after(2);
    watch(c, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_MOD);
  }

  void to_idle(Conn& c) {
    // Only what is left (a pipelined request) stays counted and held.
    if (c.in.capacity() > (256u << 10)) c.in.shrink_to_fit();
    buffered -= c.reserved - std::min(c.reserved, c.in.size());
    c.reserved = std::min(c.reserved, c.in.size());
    c.state = State::Idle;
    c.fresh = false;
    c.since = Clock::now();
    c.deadline = after(lim.idle_timeout_s);
    watch(c, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_MOD);
    if (!c.in.empty()) advance(c);  // a pipelined request already here
  }

  void accept_all() {
    for (;;) {
      sockaddr_storage a{};
      socklen_t n = sizeof(a);
      const int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&a), &n, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno != EMFILE && errno != ENFILE) return;
        // Out of descriptors: drop a waiting connection; if every one is being served, take the
        // new one with the spare descriptor to tell it so (else it would sit in the backlog and
        // keep the listener readable forever).
        if (make_room()) continue;
        ::close(spare);
        const int fd2 = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd2 >= 0) refuse_new(fd2);
        spare = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
        return;
      }
      {
        std::lock_guard<std::mutex> l(counters_mu);
        ++counts.accepted;
      }
      if (conns.size() >= lim.max_connections && !make_room()) {
        refuse_new(fd);  // every slot is serving a request: this one is told so at once
        continue;
      }
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      auto c = std::make_unique<Conn>();
      c->fd = fd;
      c->since = Clock::now();
      c->deadline = after(lim.header_timeout_s);  // a new connection's first request
      char host[NI_MAXHOST], port[NI_MAXSERV];
      if (getnameinfo(reinterpret_cast<sockaddr*>(&a), n, host, sizeof(host), port, sizeof(port),
                      NI_NUMERICHOST | NI_NUMERICSERV) == 0)
        c->addr = host, c->port = std::atoi(port);
      Conn& ref = *c;
      conns.emplace(fd, std::move(c));
      watch(ref, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_ADD);
    }
  }

  void refuse_new(int fd) {
    const std::string bytes = serialize_head(error_response(503, "the server is at its connection limit"), false, false);
    count(503);
    (void)::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    ::close(fd);
    std::lock_guard<std::mutex> l(counters_mu);
    ++counts.refused;
  }

  // Drops the connection that has waited longest without being served (idle, or still sending its
  // request), so that a new one fits. False if every connection is being served.
  bool make_room() {
    Conn* victim = nullptr;
    for (auto& [fd, c] : conns)
      if (c->state != State::Busy && (!victim || c->since < victim->since)) victim = c.get();
    if (!victim) return false;
    if (victim->state == State::Head || victim->state == State::Body) {
      const std::string bytes =
          serialize_head(error_response(503, "connection dropped to make room for others (send requests promptly)"), false, false);
      count(503);
      (void)::send(victim->fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    close_conn(victim->fd);
    std::lock_guard<std::mutex> l(counters_mu);
    ++counts.evicted;
    return true;
  }

  // Reads what has arrived, parsing as it goes so that nothing beyond the current phase's bound
  // is buffered: the head limit while the head arrives, the declared body (plus a little) after.
  void on_readable(Conn& c) {
    const int fd = c.fd;
    char buf[65536];
    for (;;) {
      if (c.state == State::Linger) {
        const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (n <= 0) return close_conn(fd);
        continue;  // discarded
      }
      const size_t slack = lim.max_header_bytes;
      const size_t cap = c.state == State::Body ? c.head.size + (c.head.chunked ? 2 * lim.max_body_bytes : size_t(c.head.content_length)) + slack
                                                : lim.max_header_bytes + slack;
      if (c.in.size() >= cap) {
        if (c.state == State::Body && c.head.chunked) return refuse(c, 413, "chunked body framing over twice the body limit");
        return;  // the rest waits in the socket until this request is answered
      }
      const ssize_t n = ::recv(fd, buf, std::min(sizeof(buf), cap - c.in.size()), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) return close_conn(fd);  // closed or reset: nothing to answer
      c.in.append(buf, size_t(n));
      if (c.in.size() > c.reserved) {
        buffered += c.in.size() - c.reserved;
        c.reserved = c.in.size();
        if (buffered > lim.max_buffered_bytes)
          return refuse(c, 503, "the server holds too many request bytes right now; retry shortly");
      }
      advance(c);
      auto it = conns.find(fd);
      if (it == conns.end() || it->second.get() != &c) return;
      if (c.state == State::Busy || c.state == State::Write) return;
    }
  }

  void advance(Conn& c) {
    if (c.state == State::Idle) {
      if (c.in.empty()) return;
      c.state = State::Head;
      if (!c.fresh) c.deadline = after(lim.header_timeout_s);
    }
    ParseError err;
    if (c.state == State::Head) {
      const Progress p = parse_head(c.in, lim, c.head, err);
      if (p == Progress::More) return;
      if (p == Progress::Error) return refuse(c, err.status, err.message);
      const size_t need = c.head.chunked ? 0 : size_t(c.head.content_length);
      if (buffered + need > lim.max_buffered_bytes + c.reserved)
        return refuse(c, 503, "the server holds too many request bytes right now; retry shortly");
      if (need > c.reserved) buffered += need - c.reserved, c.reserved = need;
      c.state = State::Body;
      c.deadline = after(lim.body_timeout_s);
      if (c.head.expect_continue && (c.head.chunked || c.head.content_length > 0) && c.in.size() == c.head.size) {
        static constexpr std::string_view cont = "HTTP/1.1 100 Continue\r\n\r\n";
        (void)::send(c.fd, cont.data(), cont.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      }
    }
    if (c.state != State::Body) return;
    auto req = std::make_shared<Request>();
    size_t consumed = 0;
    const Progress p = parse_body(std::string_view(c.in).substr(c.head.size), c.head, lim, req->body, consumed, err);
    if (p == Progress::More) return;
    if (p == Progress::Error) return refuse(c, err.status, err.message);
    static_cast<Head&>(*req) = std::move(c.head);
    c.in.erase(0, req->size + consumed);
    req->remote_addr = c.addr;
    req->remote_port = c.port;
    req->fd = c.fd;
    dispatch(c, std::move(req));
  }

  void dispatch(Conn& c, std::shared_ptr<Request> req) {
    auto it = routes.find(req->path);
    const Route* route = nullptr;
    std::string allow;
    if (it != routes.end())
      for (const Route& r : it->second) {
        if (r.method == req->method) route = &r;
        allow += (allow.empty() ? "" : ", ") + r.method;
      }
    const bool keep = req->keep_alive && !stopping;
    if (!route) {
      Response r = it == routes.end() ? error_response(404, "no such endpoint: " + req->path)
                                      : error_response(405, req->path + " takes " + allow);
      if (it != routes.end()) r.set_header("Allow", allow);
      return answer(c, r, keep);
    }
    if (route->lane == Lane::Inline) {
      Response r;
      run_handler(*route, *req, r);
      if (r.stream) r = error_response(500, "a streamed answer from an inline handler");
      return answer(c, r, keep);
    }
    c.state = State::Busy;
    epoll_ctl(ep, EPOLL_CTL_DEL, c.fd, nullptr);
    ++busy;
    Conn* cp = &c;
    Handler h = route->handler;
    Pool& pool = route->lane == Lane::Work ? work : control;
    const bool ok = pool.submit([this, cp, req, h] {
      const bool alive = serve_on_thread(*cp, *req, h);
      cp->close_on_return = !alive;
      std::lock_guard<std::mutex> l(returned_mu);
      returned.push_back(cp);
      const uint64_t one = 1;
      (void)::write(wake, &one, sizeof(one));
    });
    if (!ok) {
      --busy;
      watch(c, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_ADD);
      return answer(c, error_response(503, "all request threads are busy; retry shortly"), keep);
    }
  }

  void run_handler(const Route& route, const Request& req, Response& res) {
    try {
      route.handler(req, res);
    } catch (const std::exception& e) {
      res = error_response(500, std::string("internal error: ") + e.what());
    } catch (...) {
      res = error_response(500, "internal error");
    }
  }

  // On a lane's thread: runs the handler and writes its answer. True if the connection lives on.
  bool serve_on_thread(Conn& c, const Request& req, const Handler& h) {
    Response res;
    run_handler(Route{req.method, Lane::Work, h}, req, res);
    count(res.status);
    set_blocking(c.fd, true);
    timeval tv{};
    tv.tv_sec = time_t(lim.write_timeout_s);
    tv.tv_usec = suseconds_t((lim.write_timeout_s - double(tv.tv_sec)) * 1e6);
    setsockopt(c.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    const bool keep = req.keep_alive && !stopping;
    bool ok;
    if (!res.stream) {
      ok = send_all(c.fd, serialize_head(res, keep, false));
    } else {
      // HTTP/1.0 has no chunked framing: the body runs to the connection's end.
      const bool chunked = req.minor_version == 1;
      struct ChunkSink : Sink {
        int fd;
        bool chunked, ok = true, finished = false;
        bool write(std::string_view d) override {
          if (!ok) return false;
          if (d.empty()) return true;
          if (chunked) {
            char size[32];
            const int n = std::snprintf(size, sizeof(size), "%zx\r\n", d.size());
            ok = send_all(fd, std::string_view(size, size_t(n))) && send_all(fd, d) && send_all(fd, "\r\n");
          } else {
            ok = send_all(fd, d);
          }
          return ok;
        }
        bool client_gone() const override { return peer_closed(fd); }
        void done() override {
          if (finished) return;
          finished = true;
          if (ok && chunked) ok = send_all(fd, "0\r\n\r\n");
        }
      } sink;
      sink.fd = c.fd;
      sink.chunked = chunked;
      sink.ok = send_all(c.fd, serialize_head(res, keep && chunked, chunked));
      while (sink.ok && !sink.finished) {
        bool more = false;
        try {
          more = res.stream(sink);
        } catch (const std::exception&) {
          more = false;
        }
        if (!more) sink.ok = false;
      }
      ok = sink.ok && sink.finished && chunked;
      if (res.stream_end) res.stream_end(sink.ok && sink.finished);
    }
    set_blocking(c.fd, false);
    return ok && keep;
  }

  void take_returned() {
    uint64_t v;
    (void)::read(wake, &v, sizeof(v));
    std::vector<Conn*> back;
    {
      std::lock_guard<std::mutex> l(returned_mu);
      back.swap(returned);
    }
    for (Conn* c : back) {
      --busy;
      if (c->close_on_return || stopping) {
        shutdown(c->fd, SHUT_WR);
        close_conn(c->fd);
        continue;
      }
      watch(*c, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_ADD);
      to_idle(*c);
    }
  }

  void expire() {
    const auto now = Clock::now();
    std::vector<int> late;
    for (auto& [fd, c] : conns)
      if (c->state != State::Busy && c->deadline < now) late.push_back(fd);
    for (int fd : late) {
      Conn& c = *conns.at(fd);
      if (c.state == State::Head || c.state == State::Body) {
        std::lock_guard<std::mutex> l(counters_mu);
        ++counts.timed_out;
      }
      if (c.state == State::Head)
        refuse(c, 408, "the request head did not arrive within " + std::to_string(int(lim.header_timeout_s)) + " s");
      else if (c.state == State::Body)
        refuse(c, 408, "the request body did not arrive within " + std::to_string(int(lim.body_timeout_s)) + " s");
      else
        close_conn(fd);  // idle past its time, an answer the client does not read, a lingering close
      // A refusal that could not be written at once must not linger either.
      auto it = conns.find(fd);
      if (it != conns.end() && it->second->state == State::Write) it->second->deadline = after(1);
    }
  }

  void loop() {
    epoll_event evs[256];
    auto last_scan = Clock::now();
    bool closed_listener = false;
    for (;;) {
      const int n = epoll_wait(ep, evs, 256, 100);
      for (int i = 0; i < n; ++i) {
        const int fd = evs[i].data.fd;
        if (fd == listen_fd) {
          accept_all();
          continue;
        }
        if (fd == wake) {
          take_returned();
          continue;
        }
        auto it = conns.find(fd);
        if (it == conns.end()) continue;
        Conn& c = *it->second;
        if (c.state == State::Write) {
          if (evs[i].events & (EPOLLERR | EPOLLHUP)) close_conn(fd);
          else flush(c);
        } else if (c.state == State::Idle && (evs[i].events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) &&
                   !(evs[i].events & EPOLLIN)) {
          close_conn(fd);
        } else if (c.state != State::Busy) {
          on_readable(c);
        }
      }
      if (Clock::now() - last_scan > std::chrono::milliseconds(100)) {
        expire();
        last_scan = Clock::now();
      }
      if (stopping) {
        if (!closed_listener) {
          epoll_ctl(ep, EPOLL_CTL_DEL, listen_fd, nullptr);
          ::close(listen_fd);
          listen_fd = -1;
          closed_listener = true;
          std::vector<int> idle;
          for (auto& [fd, c] : conns)
            if (c->state == State::Idle) idle.push_back(fd);
          for (int fd : idle) close_conn(fd);
        }
        if (busy == 0) break;
      }
      publish();
    }
    std::vector<int> rest;
    for (auto& [fd, c] : conns) rest.push_back(fd);
    for (int fd : rest) close_conn(fd);
    publish();
  }
};

Server::Server(Limits lim) : impl_(std::make_unique<Impl>(lim)) {}

Server::~Server() {
  impl_->work.join();
  impl_->control.join();
  if (impl_->listen_fd >= 0) ::close(impl_->listen_fd);
  if (impl_->ep >= 0) ::close(impl_->ep);
  if (impl_->wake >= 0) ::close(impl_->wake);
  if (impl_->spare >= 0) ::close(impl_->spare);
}

void Server::route(const std::string& method, const std::string& path, Lane lane, Handler h) {
  impl_->routes[path].push_back(Route{method, lane, std::move(h)});
}

void Server::on_error(std::function<void(int, const std::string&, Response&)> f) { impl_->error_fn = std::move(f); }
void Server::on_status(std::function<void(int)> f) { impl_->status_fn = std::move(f); }

int Server::bind(const std::string& host, int port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  const std::string p = std::to_string(port);
  if (const int rc = getaddrinfo(host.c_str(), p.c_str(), &hints, &res); rc != 0)
    throw error("serve", "cannot resolve ", host, ": ", gai_strerror(rc));
  std::string why = "no address";
  int fd = -1;
  for (addrinfo* a = res; a; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) break;
    why = std::strerror(errno);
    ::close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0) throw error("serve", "cannot listen on ", host, ":", port, " (", why, ")");
  sockaddr_storage a{};
  socklen_t n = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  impl_->listen_fd = fd;
  return a.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port)
                                 : ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
}

void Server::run() {
  Impl& m = *impl_;
  K3_CHECK(m.listen_fd >= 0, "http: run() before bind()");
  m.ep = epoll_create1(EPOLL_CLOEXEC);
  m.wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  K3_CHECK(m.ep >= 0 && m.wake >= 0, "http: cannot create the event loop: ", std::strerror(errno));
  for (int fd : {m.listen_fd, m.wake}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    epoll_ctl(m.ep, EPOLL_CTL_ADD, fd, &ev);
  }
  m.loop();
}

void Server::stop() {
  impl_->stopping = true;
  if (impl_->wake >= 0) {
    const uint64_t one = 1;
    (void)::write(impl_->wake, &one, sizeof(one));
  }
}

Server::Counters Server::counters() const {
  std::lock_guard<std::mutex> l(impl_->counters_mu);
  return impl_->counts;
}

}  // namespace k3::http
