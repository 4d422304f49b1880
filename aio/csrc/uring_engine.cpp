// io_uring engine of infinity.aio; see uring_engine.hpp for the threading model.
#include "uring_engine.hpp"

#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <future>

namespace infinity::aio {

namespace {

constexpr uint64_t kWakeTag = ~uint64_t{0};

// Setup flags, best first; the kernel answers EINVAL to flags it does not know, and we step
// down as fio does. SINGLE_ISSUER|DEFER_TASKRUN (6.1) runs completion work only when the
// worker enters the kernel, with no cross-thread wakeups; COOP_TASKRUN (5.19) at least avoids
// interrupting the worker; SUBMIT_ALL keeps a batch going past one bad SQE.
struct SetupTier {
  unsigned flags;
  const char* name;
};
constexpr SetupTier kSetupTiers[] = {
    {IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_SUBMIT_ALL,
     "SINGLE_ISSUER|DEFER_TASKRUN|SUBMIT_ALL"},
    {IORING_SETUP_COOP_TASKRUN | IORING_SETUP_SUBMIT_ALL, "COOP_TASKRUN|SUBMIT_ALL"},
    {0, "none"},
};

int try_setup(unsigned entries, io_uring* ring, std::string* flags_name) {
  int ret = -EINVAL;
  for (const auto& tier : kSetupTiers) {
    io_uring_params params{};
    params.flags = tier.flags;
    ret = io_uring_queue_init_params(entries, ring, &params);
    if (ret == 0) {
      if (flags_name) *flags_name = tier.name;
      return 0;
    }
    if (ret != -EINVAL) break;
  }
  return ret;
}

}  // namespace

std::string errno_text(int err) {
  const char* name = strerrorname_np(err);
  return std::string(name ? name : "E?") + " (" + strerror(err) + ")";
}

// ---- Request ------------------------------------------------------------------------------

bool Request::wait(double timeout_s) {
  if (done()) return true;
  std::unique_lock<std::mutex> lock(mu_);
  auto is_done = [this] { return done(); };
  if (timeout_s < 0) {
    cv_.wait(lock, is_done);
    return true;
  }
  return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), is_done);
}

void Request::complete() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

// ---- Ring: caller side --------------------------------------------------------------------

Ring::Ring(unsigned queue_depth, uint32_t block_size)
    : queue_depth_(queue_depth), block_size_(block_size), owner_pid_(getpid()) {
  if (queue_depth == 0 || block_size == 0) {
    throw Error(EINVAL, "queue_depth and block_size must be positive");
  }
  chunks_.resize(queue_depth);
  for (uint32_t i = queue_depth; i-- > 0;) free_chunks_.push_back(i);
  buffer_used_.assign(kBufferSlots, false);
  file_used_.assign(kFileSlots, false);

  std::promise<int> ready;
  std::future<int> setup_err = ready.get_future();
  worker_ = std::thread(&Ring::run, this, &ready);
  int err = setup_err.get();
  if (err != 0) {
    worker_.join();
    throw Error(err, "io_uring_setup: " + errno_text(err));
  }
}

Ring::~Ring() { close(false); }

void Ring::refuse(const std::shared_ptr<Request>& req, int err) {
  req->error_ = err;
  req->completed_ = true;
  req->complete();
}

void Ring::submit(const std::shared_ptr<Request>& req) {
  std::lock_guard<std::mutex> lock(mu_);
  // The engine owns the request before it is handed over, so a refused one is completed with
  // the reason: whoever holds it finds it done rather than waiting for ever.
  auto fail = [&req](int err, const std::string& what) {
    refuse(req, err);
    throw Error(err, what);
  };
  if (closing_ || stopped_) fail(ESHUTDOWN, "the uring aio engine is closed");
  if (broken_) fail(broken_, "the uring aio engine failed: " + errno_text(broken_));
  incoming_.push_back(req);
  // Under mu_, so the worker cannot close the eventfd between our check and this write.
  uint64_t one = 1;
  if (::write(wake_fd_, &one, sizeof(one)) < 0 && errno != EAGAIN) {
    int err = errno;
    incoming_.pop_back();
    fail(err, "eventfd write: " + errno_text(err));
  }
}

void Ring::call(std::function<int()> fn, int* result) {
  std::promise<int> done;
  std::future<int> value = done.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_ || stopped_) throw Error(ESHUTDOWN, "the uring aio engine is closed");
    commands_.push_back([&] { done.set_value(fn()); });
    uint64_t one = 1;
    if (::write(wake_fd_, &one, sizeof(one)) < 0 && errno != EAGAIN) {
      commands_.pop_back();
      throw Error(errno, "eventfd write: " + errno_text(errno));
    }
  }
  *result = value.get();
}

int Ring::register_buffer(void* addr, size_t nbytes) {
  int ret = 0;
  call(
      [&]() -> int {
        if (!buffers_sparse_) return -EOPNOTSUPP;
        int slot = alloc_slot(buffer_used_);
        if (slot < 0) return -ENOSPC;
        iovec iov{addr, nbytes};
        __u64 tag = 0;
        int r = io_uring_register_buffers_update_tag(&ring_, slot, &iov, &tag, 1);
        if (r < 0) {
          buffer_used_[slot] = false;
          return r;
        }
        auto start = reinterpret_cast<uintptr_t>(addr);
        regions_[start] = Region{start + nbytes, slot};
        return slot;
      },
      &ret);
  if (ret < 0) throw Error(-ret, "io_uring_register_buffers_update_tag: " + errno_text(-ret));
  return ret;
}

void Ring::unregister_buffer(int slot) {
  int ret = 0;
  call(
      [&]() -> int {
        if (slot < 0 || slot >= kBufferSlots || !buffer_used_[slot]) return -EINVAL;
        for (auto it = regions_.begin(); it != regions_.end(); ++it) {
          if (it->second.slot == slot) {
            regions_.erase(it);
            break;
          }
        }
        // The kernel keeps the old pages pinned until SQEs already using them complete.
        iovec iov{nullptr, 0};
        __u64 tag = 0;
        int r = io_uring_register_buffers_update_tag(&ring_, slot, &iov, &tag, 1);
        buffer_used_[slot] = false;
        return r < 0 ? r : 0;
      },
      &ret);
  if (ret < 0) throw Error(-ret, "unregister buffer: " + errno_text(-ret));
}

int Ring::register_file(int fd) {
  int ret = 0;
  call(
      [&]() -> int {
        if (!files_sparse_) return -EOPNOTSUPP;
        int slot = alloc_slot(file_used_);
        if (slot < 0) return -ENOSPC;
        int r = io_uring_register_files_update(&ring_, slot, &fd, 1);
        if (r < 0) {
          file_used_[slot] = false;
          return r;
        }
        return slot;
      },
      &ret);
  if (ret < 0) throw Error(-ret, "io_uring_register_files_update: " + errno_text(-ret));
  return ret;
}

void Ring::unregister_file(int slot) {
  int ret = 0;
  call(
      [&]() -> int {
        if (slot < 0 || slot >= kFileSlots || !file_used_[slot]) return -EINVAL;
        int none = -1;
        int r = io_uring_register_files_update(&ring_, slot, &none, 1);
        file_used_[slot] = false;
        return r < 0 ? r : 0;
      },
      &ret);
  if (ret < 0) throw Error(-ret, "unregister file: " + errno_text(-ret));
}

void Ring::close(bool cancel) {
  if (getpid() != owner_pid_) {
    // A forked child has the ring's memory but not its worker thread: joining would wait
    // forever, and the ring belongs to the parent. Let go of it.
    std::lock_guard<std::mutex> lock(join_mu_);
    if (worker_.joinable()) worker_.detach();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopped_) {
      closing_ = true;
      cancel_ = cancel_ || cancel;
      uint64_t one = 1;
      (void)!::write(wake_fd_, &one, sizeof(one));
    }
  }
  std::lock_guard<std::mutex> lock(join_mu_);
  if (worker_.joinable()) worker_.join();
}

Counters Ring::counters() const {
  Counters c;
  c.requests = c_requests_.load();
  c.chunks = c_chunks_.load();
  c.sqes = c_sqes_.load();
  c.enters = c_enters_.load();
  c.fixed = c_fixed_.load();
  c.retries = c_retries_.load();
  c.short_transfers = c_short_.load();
  c.errors = c_errors_.load();
  c.bytes_read = c_read_.load();
  c.bytes_written = c_written_.load();
  return c;
}

// ---- Ring: worker side --------------------------------------------------------------------

int Ring::setup() {
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) return errno;
  // One SQE more than queue_depth for the wake-up poll.
  int ret = try_setup(queue_depth_ + 1, &ring_, &setup_flags_);
  if (ret < 0) {
    ::close(wake_fd_);
    wake_fd_ = -1;
    return -ret;
  }
  // Sparse tables (5.13+) let buffers and files come and go one slot at a time. Without
  // them the engine still works, only without fixed buffers and files.
  buffers_sparse_ = io_uring_register_buffers_sparse(&ring_, kBufferSlots) == 0;
  files_sparse_ = io_uring_register_files_sparse(&ring_, kFileSlots) == 0;
  return 0;
}

void Ring::run(std::promise<int>* ready) {
  int err = setup();
  if (err != 0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
    }
    ready->set_value(err);
    return;
  }
  ready->set_value(0);  // `ready` dies with the constructor from here on

  bool cancelled = false;
  for (;;) {
    bool closing = take_incoming(&cancelled);
    fill();
    if (inflight_ == 0 && !wake_armed_) {
      if (closing && pending_.empty() && retry_.empty()) break;
      if (!closing && !arm_wake()) {
        fail_all(EIO);
        break;
      }
    }
    // One io_uring_enter submits the batch prepared by fill() and waits for a completion:
    // an I/O chunk, or the wake-up poll when a caller hands work over.
    int ret = io_uring_submit_and_wait(&ring_, 1);
    c_enters_.fetch_add(1, std::memory_order_relaxed);
    if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY && ret != -ETIME) {
      // The ring itself failed: nothing more can be submitted or reaped reliably.
      broken_ = -ret;
      fail_all(-ret);
      break;
    }
    reap();
  }

  io_uring_queue_exit(&ring_);
  std::lock_guard<std::mutex> lock(mu_);
  stopped_ = true;
  ::close(wake_fd_);
  wake_fd_ = -1;
}

bool Ring::arm_wake() {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (!sqe) return false;
  io_uring_prep_poll_add(sqe, wake_fd_, POLLIN);
  sqe->user_data = kWakeTag;
  wake_armed_ = true;
  return true;
}

bool Ring::take_incoming(bool* cancelled) {
  std::deque<std::shared_ptr<Request>> incoming;
  std::deque<std::function<void()>> commands;
  bool closing, cancel;
  {
    std::lock_guard<std::mutex> lock(mu_);
    incoming.swap(incoming_);
    commands.swap(commands_);
    closing = closing_;
    cancel = cancel_;
  }
  for (auto& command : commands) command();
  for (auto& req : incoming) {
    if (req->urgent_) {  // after the urgent ones waiting, before the rest (see submit)
      auto it = std::find_if(pending_.begin(), pending_.end(),
                             [](const std::shared_ptr<Request>& p) { return !p->urgent_; });
      pending_.insert(it, std::move(req));
    } else {
      pending_.push_back(std::move(req));
    }
  }
  if (cancel && !*cancelled) {
    *cancelled = true;
    // Requests still holding uncut bytes fail; their chunks in the kernel finish normally.
    for (auto& req : pending_) {
      if (!req->stop_) {
        req->stop_ = true;
        if (!req->error_) req->error_ = ECANCELED;
      }
    }
  }
  return closing;
}

int Ring::alloc_slot(std::vector<bool>& used) {
  for (size_t i = 0; i < used.size(); ++i) {
    if (!used[i]) {
      used[i] = true;
      return static_cast<int>(i);
    }
  }
  return -1;
}

int Ring::find_region(const char* p, uint32_t len) const {
  auto start = reinterpret_cast<uintptr_t>(p);
  auto it = regions_.upper_bound(start);
  if (it == regions_.begin()) return -1;
  --it;
  return start + len <= it->second.end ? it->second.slot : -1;
}

bool Ring::prep(uint32_t idx) {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (!sqe) return false;
  Chunk& c = chunks_[idx];
  const Request& r = *c.req;
  char* p = c.buf + c.done;
  uint32_t n = c.len - c.done;
  uint64_t off = c.offset + c.done;
  int fd = r.file_slot_ >= 0 ? r.file_slot_ : r.fd_;
  int buf_slot = find_region(p, n);
  if (r.write_) {
    if (buf_slot >= 0) {
      io_uring_prep_write_fixed(sqe, fd, p, n, off, buf_slot);
    } else {
      io_uring_prep_write(sqe, fd, p, n, off);
    }
  } else {
    if (buf_slot >= 0) {
      io_uring_prep_read_fixed(sqe, fd, p, n, off, buf_slot);
    } else {
      io_uring_prep_read(sqe, fd, p, n, off);
    }
  }
  if (r.file_slot_ >= 0) sqe->flags |= IOSQE_FIXED_FILE;
  sqe->user_data = idx;
  ++inflight_;
  c_sqes_.fetch_add(1, std::memory_order_relaxed);
  if (buf_slot >= 0) c_fixed_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void Ring::fill() {
  // Continuations first: they already hold a chunk slot.
  while (!retry_.empty() && inflight_ < queue_depth_) {
    uint32_t idx = retry_.front();
    Request& r = *chunks_[idx].req;
    if (r.stop_ && r.error_) {  // failed or cancelled meanwhile
      retry_.pop_front();
      finish_chunk(idx);
      continue;
    }
    if (!prep(idx)) return;
    retry_.pop_front();
  }
  while (!pending_.empty()) {
    Request& r = *pending_.front();
    if (r.stop_ || r.next_ >= r.nbytes_) {
      auto req = std::move(pending_.front());
      pending_.pop_front();
      if (req->live_ == 0) complete(req);
      continue;
    }
    if (free_chunks_.empty() || inflight_ >= queue_depth_) return;
    uint32_t idx = free_chunks_.back();
    Chunk& c = chunks_[idx];
    c.req = pending_.front();
    c.offset = r.offset_ + r.next_;
    c.buf = r.buf_ + r.next_;
    c.len = static_cast<uint32_t>(std::min<uint64_t>(block_size_, r.nbytes_ - r.next_));
    c.done = 0;
    if (!prep(idx)) {
      c = Chunk{};
      return;
    }
    free_chunks_.pop_back();
    r.next_ += c.len;
    ++r.live_;
  }
}

void Ring::reap() {
  unsigned head;
  unsigned seen = 0;
  io_uring_cqe* cqe;
  io_uring_for_each_cqe(&ring_, head, cqe) {
    ++seen;
    if (cqe->user_data == kWakeTag) {
      uint64_t value;
      (void)!::read(wake_fd_, &value, sizeof(value));  // reset; EAGAIN is fine
      wake_armed_ = false;
      continue;
    }
    --inflight_;
    on_chunk(static_cast<uint32_t>(cqe->user_data), cqe->res);
  }
  io_uring_cq_advance(&ring_, seen);
}

void Ring::on_chunk(uint32_t idx, int res) {
  Chunk& c = chunks_[idx];
  Request& r = *c.req;
  if (res == -EAGAIN || res == -EINTR) {
    c_retries_.fetch_add(1, std::memory_order_relaxed);
    retry_.push_back(idx);  // fill() drops it if the request has failed meanwhile
    return;
  }
  if (res < 0) {
    if (!r.error_) r.error_ = -res;
    r.stop_ = true;
    finish_chunk(idx);
    return;
  }
  if (res == 0) {
    if (r.write_) {
      if (!r.error_) r.error_ = EIO;  // a write that moves nothing would loop forever
    }
    r.stop_ = true;  // a read at end of file: the request ends with what it has
    finish_chunk(idx);
    return;
  }
  c.done += static_cast<uint32_t>(res);
  r.transferred_ += static_cast<uint64_t>(res);
  (r.write_ ? c_written_ : c_read_).fetch_add(static_cast<uint64_t>(res), std::memory_order_relaxed);
  if (c.done < c.len) {
    c_short_.fetch_add(1, std::memory_order_relaxed);
    if (!r.write_ && r.direct_) {
      // Under O_DIRECT a short read happens only at end of file, whose offset may not be
      // aligned enough to ask again.
      r.stop_ = true;
      finish_chunk(idx);
      return;
    }
    retry_.push_back(idx);
    return;
  }
  finish_chunk(idx);
}

void Ring::finish_chunk(uint32_t idx) {
  std::shared_ptr<Request> req = std::move(chunks_[idx].req);
  chunks_[idx] = Chunk{};
  free_chunks_.push_back(idx);
  c_chunks_.fetch_add(1, std::memory_order_relaxed);
  --req->live_;
  if (req->live_ == 0 && (req->stop_ || req->next_ >= req->nbytes_)) complete(req);
}

void Ring::complete(const std::shared_ptr<Request>& req) {
  if (req->completed_) return;
  req->completed_ = true;
  c_requests_.fetch_add(1, std::memory_order_relaxed);
  if (req->error_) c_errors_.fetch_add(1, std::memory_order_relaxed);
  req->complete();
}

void Ring::fail_all(int err) {
  // Only reached when the ring itself is unusable; chunks the kernel may still hold are
  // given up too, since no completion for them can be relied on any more.
  auto fail = [err](Request& r) {
    r.stop_ = true;
    if (!r.error_) r.error_ = err;
  };
  for (auto& chunk : chunks_) {
    if (chunk.req) fail(*chunk.req);
  }
  for (auto& chunk : chunks_) {
    if (chunk.req) complete(chunk.req);
  }
  for (auto& req : pending_) {
    fail(*req);
    complete(req);
  }
  pending_.clear();
  retry_.clear();
  std::deque<std::shared_ptr<Request>> incoming;
  {
    std::lock_guard<std::mutex> lock(mu_);
    incoming.swap(incoming_);
    closing_ = true;
  }
  for (auto& req : incoming) {
    fail(*req);
    complete(req);
  }
}

// ---- free functions -----------------------------------------------------------------------

std::pair<uint32_t, uint32_t> dio_alignment(int fd) {
#ifdef STATX_DIOALIGN
  struct statx stx {};
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) != 0) {
    throw Error(errno, "statx: " + errno_text(errno));
  }
  if (stx.stx_mask & STATX_DIOALIGN) return {stx.stx_dio_mem_align, stx.stx_dio_offset_align};
#else
  (void)fd;
#endif
  return {0, 0};
}

std::string probe() {
  io_uring ring{};
  int ret = try_setup(4, &ring, nullptr);
  if (ret < 0) return "io_uring_setup: " + errno_text(-ret);
  std::string missing;
  if (io_uring_probe* p = io_uring_get_probe_ring(&ring)) {
    const std::pair<int, const char*> ops[] = {
        {IORING_OP_READ, "READ"},           {IORING_OP_WRITE, "WRITE"},
        {IORING_OP_READ_FIXED, "READ_FIXED"}, {IORING_OP_WRITE_FIXED, "WRITE_FIXED"},
        {IORING_OP_POLL_ADD, "POLL_ADD"},
    };
    for (const auto& [op, name] : ops) {
      if (!io_uring_opcode_supported(p, op)) missing += std::string(missing.empty() ? "" : ", ") + name;
    }
    io_uring_free_probe(p);
  } else {
    missing = "IORING_REGISTER_PROBE";
  }
  io_uring_queue_exit(&ring);
  if (!missing.empty()) return "io_uring lacks operations the engine needs: " + missing;
  return "";
}

}  // namespace infinity::aio
