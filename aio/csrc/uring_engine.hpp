// io_uring engine of infinity.aio: positional reads and writes of host memory.
//
// No Python and no torch here: requests are (fd, pointer, nbytes, offset). The Python binding
// (bindings.cpp) and wrapper (aio/_uring_engine.py) keep buffers alive until completion.
//
// Threading: one worker thread owns the ring. It creates it (so the kernel may run it with
// SINGLE_ISSUER|DEFER_TASKRUN), submits, reaps and registers; other threads only hand work
// over through a queue and wake it with an eventfd that the ring itself polls. So one
// io_uring_enter both submits a batch and waits, and a request arriving while the worker
// sleeps in the kernel is picked up at once.
#pragma once

#include <liburing.h>
#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace infinity::aio {

// An error with an errno, raised as OSError by the binding.
class Error : public std::runtime_error {
 public:
  Error(int err, const std::string& what) : std::runtime_error(what), err_(err) {}
  int code() const noexcept { return err_; }

 private:
  int err_;
};

// "EPERM (Operation not permitted)"
std::string errno_text(int err);

// One pread/pwrite. Completed exactly once by the worker; waited on by anyone.
class Request {
 public:
  Request(bool write, int fd, char* buf, uint64_t nbytes, uint64_t offset, bool direct, int file_slot,
          bool urgent = false)
      : write_(write), fd_(fd), buf_(buf), nbytes_(nbytes), offset_(offset), direct_(direct),
        file_slot_(file_slot), urgent_(urgent) {}

  bool done() const noexcept { return done_.load(std::memory_order_acquire); }
  // Blocks until done or timeout_s passes (forever when negative); returns done().
  bool wait(double timeout_s);
  // Valid once done(): bytes moved (short only for a read that reached EOF) and errno (0: ok).
  uint64_t bytes() const noexcept { return transferred_; }
  int error() const noexcept { return error_; }

 private:
  friend class Ring;
  void complete();

  // Fixed at submit.
  const bool write_;
  const int fd_;
  char* const buf_;
  const uint64_t nbytes_;
  const uint64_t offset_;
  const bool direct_;
  const int file_slot_;  // fixed-file index, or -1
  const bool urgent_;     // cut into chunks before every request that is not

  // Worker-only until complete().
  uint64_t next_ = 0;     // first byte not yet cut into a chunk
  uint32_t live_ = 0;     // chunks cut and not finished
  bool stop_ = false;     // error, EOF or cancel: cut no more chunks
  bool completed_ = false;
  uint64_t transferred_ = 0;
  int error_ = 0;

  std::atomic<bool> done_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

struct Counters {
  uint64_t requests = 0;       // requests completed
  uint64_t chunks = 0;         // chunks completed
  uint64_t sqes = 0;           // I/O SQEs submitted (chunks plus resubmissions)
  uint64_t enters = 0;         // io_uring_enter calls (submit and wait together)
  uint64_t fixed = 0;          // SQEs that used a registered buffer (READ_FIXED/WRITE_FIXED)
  uint64_t retries = 0;        // -EAGAIN/-EINTR resubmissions
  uint64_t short_transfers = 0;
  uint64_t errors = 0;         // requests that failed
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
};

class Ring {
 public:
  // Throws Error when the ring cannot be set up (errno of io_uring_setup).
  Ring(unsigned queue_depth, uint32_t block_size);
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  // Hands ``req`` (made by the caller, who owns it first: see the binding) to the worker. An
  // urgent request is cut into chunks before the requests waiting that are not urgent (after
  // the urgent ones already waiting): a read needed now overtakes reads ahead. When the ring
  // is closed or broken, ``req`` is completed with that errno and Error is thrown.
  void submit(const std::shared_ptr<Request>& req);
  // Completes ``req``, never handed over, with ``err`` (its owner may be waiting on it).
  static void refuse(const std::shared_ptr<Request>& req, int err);

  // Registered buffers and files live in sparse tables, updated one slot at a time. Return
  // the slot; throw Error when the kernel refuses (ENOMEM: RLIMIT_MEMLOCK, say) or the table
  // is full (ENOSPC).
  int register_buffer(void* addr, size_t nbytes);
  void unregister_buffer(int slot);
  int register_file(int fd);
  void unregister_file(int slot);

  // Waits for everything handed over; with cancel, requests with chunks not yet submitted
  // fail with ECANCELED instead (chunks already in the kernel always complete).
  void close(bool cancel);

  Counters counters() const;
  const std::string& setup_flags() const noexcept { return setup_flags_; }

  static constexpr int kBufferSlots = 1024;
  static constexpr int kFileSlots = 1024;

 private:
  struct Chunk {
    std::shared_ptr<Request> req;
    uint64_t offset = 0;  // file offset of the chunk
    char* buf = nullptr;
    uint32_t len = 0;
    uint32_t done = 0;    // bytes already transferred (short transfers continue from here)
  };
  struct Region {
    uintptr_t end;
    int slot;
  };

  void run(std::promise<int>* ready);
  int setup();
  bool arm_wake();
  bool take_incoming(bool* cancelled);  // returns closing
  void fill();
  bool prep(uint32_t idx);
  void reap();
  void on_chunk(uint32_t idx, int res);
  void finish_chunk(uint32_t idx);
  void complete(const std::shared_ptr<Request>& req);
  void fail_all(int err);
  void call(std::function<int()> fn, int* result);
  int alloc_slot(std::vector<bool>& used);
  int find_region(const char* p, uint32_t len) const;

  const unsigned queue_depth_;
  const uint32_t block_size_;
  const pid_t owner_pid_;
  io_uring ring_{};
  bool ring_ok_ = false;
  int wake_fd_ = -1;
  std::string setup_flags_;
  bool buffers_sparse_ = false;
  bool files_sparse_ = false;

  // Shared with submitters, under mu_.
  std::mutex mu_;
  std::deque<std::shared_ptr<Request>> incoming_;
  std::deque<std::function<void()>> commands_;
  bool closing_ = false;
  bool cancel_ = false;
  bool stopped_ = false;  // worker has exited
  std::atomic<int> broken_{0};  // errno of a failed io_uring_enter
  std::mutex join_mu_;

  // Worker-only.
  std::deque<std::shared_ptr<Request>> pending_;  // requests with bytes not yet cut
  std::vector<Chunk> chunks_;                     // queue_depth slots
  std::vector<uint32_t> free_chunks_;
  std::deque<uint32_t> retry_;                    // chunks to resubmit (short, EAGAIN)
  unsigned inflight_ = 0;                         // I/O SQEs in the kernel
  bool wake_armed_ = false;
  uint64_t wake_value_ = 0;
  std::map<uintptr_t, Region> regions_;           // registered buffers by start address
  std::vector<bool> buffer_used_;
  std::vector<bool> file_used_;

  std::atomic<uint64_t> c_requests_{0}, c_chunks_{0}, c_sqes_{0}, c_enters_{0}, c_fixed_{0},
      c_retries_{0}, c_short_{0}, c_errors_{0}, c_read_{0}, c_written_{0};

  std::thread worker_;
};

// Memory and offset alignment O_DIRECT needs on fd (statx STATX_DIOALIGN); {0, 0} if unknown.
std::pair<uint32_t, uint32_t> dio_alignment(int fd);

// Empty when io_uring works here with the operations the engine uses; otherwise why not
// ("io_uring_setup: EPERM (Operation not permitted)").
std::string probe();

}  // namespace infinity::aio
