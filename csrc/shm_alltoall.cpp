// See shm_alltoall.h.
#include "shm_alltoall.h"

#include "binding.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <climits>
#include <cstring>
#include <stdexcept>
#include <thread>

#if defined(__linux__)
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

namespace sparsecomm {

namespace {

constexpr uint64_t kMagicBase = 0x73706373686d3031ULL;  // "spcshm01"
constexpr size_t kLine = 64;
constexpr size_t kWhy = 256;
constexpr double kCheckSeconds = 0.1;  // how often a waiting rank checks its peers are alive
constexpr double kSpinSeconds = 20e-6;  // spin this long before sleeping, when every rank has a core

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

#if defined(__linux__)
int available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::thread::hardware_concurrency());
}
// Whether process `pid` still runs: it exists and is not a zombie (a dead child its parent has not reaped yet,
// as under a launcher busy joining other ranks).
bool process_alive(int64_t pid) {
  if (pid <= 0) return true;  // unknown: only the timeout applies
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno != ESRCH;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;
  char buf[512];
  const size_t got = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[got] = '\0';
  const char* close = std::strrchr(buf, ')');  // the command name may hold spaces and parentheses
  if (close == nullptr || close[1] == '\0' || close[2] == '\0') return true;
  return close[2] != 'Z' && close[2] != 'X';
}
#endif

}  // namespace

struct ShmAllToAll::Channel {
  alignas(kLine) std::atomic<uint64_t> posted;  // chunks src has put in the slot (ever)
  alignas(kLine) std::atomic<uint64_t> taken;   // chunks dst has copied out (ever)
  alignas(kLine) uint64_t bytes;                // the slot's chunk: its bytes
  uint64_t total;                               // and its whole message's bytes
};

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<int32_t>::is_always_lock_free,
              "the segment's counters must be lock-free atomics (shared between processes)");

struct ShmAllToAll::Header {
  uint64_t magic;
  int32_t world;
  int32_t reserved;
  uint64_t slot_bytes;
  std::atomic<int32_t> failed_rank;  // -1, or the first rank that failed a call
  std::atomic<int32_t> why_ready;    // 1 once `why` holds that rank's message
  char why[kWhy];
};

// Two builds whose segment layouts differ never open each other's segment.
constexpr uint64_t kMagic = kMagicBase ^ (static_cast<uint64_t>(sizeof(ShmAllToAll::Header)) << 16) ^
                            (static_cast<uint64_t>(sizeof(ShmAllToAll::Channel)) << 40);

// Segment: Header | pids (int64 per rank) | per rank a line {doorbell, waiters} | channels | a slot per ordered
// pair of distinct ranks.
namespace {
struct Layout {
  size_t pids, bells, channels, slots, size;
  Layout(int world, uint64_t slot, size_t header, size_t channel) {
    const size_t pairs = static_cast<size_t>(world) * world;
    const size_t peer_pairs = static_cast<size_t>(world) * (world - 1);  // a rank copies to itself directly
    pids = align_up(header, kLine);
    bells = align_up(pids + 8 * static_cast<size_t>(world), kLine);
    channels = bells + kLine * world;
    slots = align_up(channels + channel * pairs, 4096);
    size = slots + peer_pairs * slot;
  }
};
}  // namespace

#if defined(__linux__)

ShmAllToAll::ShmAllToAll(const std::string& path, bool create, int rank, int world, uint64_t slot_bytes)
    : rank_(rank), world_(world), slot_(slot_bytes), sent_(world, 0), taken_(world, 0) {
  if (world < 1 || rank < 0 || rank >= world) throw std::invalid_argument("sparsecomm shm: bad rank or world");
  if (slot_bytes < 4096 || slot_bytes % 64) throw std::invalid_argument("sparsecomm shm: slot_bytes must be >= 4096, a multiple of 64");
  const Layout lay(world, slot_bytes, sizeof(Header), sizeof(Channel));
  size_ = lay.size;
  pids_ = lay.pids;
  bells_ = lay.bells;
  channels_ = lay.channels;
  slots_ = lay.slots;
  fd_ = ::open(path.c_str(), (create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR) | O_CLOEXEC, 0600);
  if (fd_ < 0) throw std::runtime_error("sparsecomm shm: cannot open " + path + ": " + std::strerror(errno));
  if (create) {
    // Reserve every page now: a tmpfs file extended with ftruncate alone would SIGBUS on a full /dev/shm.
    const int err = ::posix_fallocate(fd_, 0, static_cast<off_t>(size_));
    if (err != 0) {
      ::close(fd_);
      throw std::runtime_error("sparsecomm shm: cannot reserve " + std::to_string(size_) + " bytes in " + path +
                               ": " + std::strerror(err));
    }
  } else {
    struct stat st;
    if (::fstat(fd_, &st) != 0 || static_cast<uint64_t>(st.st_size) != size_) {
      ::close(fd_);
      throw std::runtime_error("sparsecomm shm: " + path + " does not have the expected size");
    }
  }
  void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    ::close(fd_);
    throw std::runtime_error(std::string("sparsecomm shm: mmap failed: ") + std::strerror(errno));
  }
  base_ = static_cast<uint8_t*>(p);
  ::close(fd_);  // the mapping keeps the segment
  fd_ = -1;
  Header* h = reinterpret_cast<Header*>(base_);
  if (create) {
    // The file is zero-filled: counters start at 0. Fill the header, the magic last.
    h->world = world;
    h->slot_bytes = slot_bytes;
    h->failed_rank.store(-1, std::memory_order_relaxed);
    h->why_ready.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->store(kMagic, std::memory_order_release);
  } else if (reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->load(std::memory_order_acquire) != kMagic ||
             h->world != world || h->slot_bytes != slot_bytes) {
    ::munmap(base_, size_);
    base_ = nullptr;
    throw std::runtime_error("sparsecomm shm: " + path + " is not this group's segment");
  }
  reinterpret_cast<int64_t*>(base_ + pids_)[rank] = static_cast<int64_t>(::getpid());
  spin_ = world <= available_cores();
}

ShmAllToAll::~ShmAllToAll() {
  if (base_ != nullptr) ::munmap(base_, size_);
  if (fd_ >= 0) ::close(fd_);
}

ShmAllToAll::Channel& ShmAllToAll::channel(int src, int dst) const {
  return reinterpret_cast<Channel*>(base_ + channels_)[static_cast<size_t>(src) * world_ + dst];
}

uint8_t* ShmAllToAll::slot(int src, int dst) const {
  // Slots of the ordered pairs of distinct ranks: src's n-1 slots, dst in rank order skipping src.
  const size_t k = static_cast<size_t>(src) * (world_ - 1) + static_cast<size_t>(dst < src ? dst : dst - 1);
  return base_ + slots_ + k * slot_;
}

std::atomic<uint32_t>& ShmAllToAll::doorbell(int r) const {
  return *reinterpret_cast<std::atomic<uint32_t>*>(base_ + bells_ + kLine * r);
}

std::atomic<uint32_t>& ShmAllToAll::waiters(int r) const {
  return *reinterpret_cast<std::atomic<uint32_t>*>(base_ + bells_ + kLine * r + 4);
}

void ShmAllToAll::ring(int r) const {
  doorbell(r).fetch_add(1, std::memory_order_seq_cst);
  if (waiters(r).load(std::memory_order_seq_cst) != 0)
    ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&doorbell(r)), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

bool ShmAllToAll::failed() const {
  return reinterpret_cast<Header*>(base_)->failed_rank.load(std::memory_order_acquire) >= 0;
}

void ShmAllToAll::fail(const std::string& why) {
  Header* h = reinterpret_cast<Header*>(base_);
  int32_t expected = -1;
  if (h->failed_rank.compare_exchange_strong(expected, rank_)) {
    std::strncpy(h->why, why.c_str(), kWhy - 1);
    h->why[kWhy - 1] = '\0';
    h->why_ready.store(1, std::memory_order_release);
  }
  for (int r = 0; r < world_; ++r)
    if (r != rank_) ring(r);
  throw std::runtime_error(why);
}

void ShmAllToAll::raise_peer_failure() const {
  Header* h = reinterpret_cast<Header*>(base_);
  const int who = h->failed_rank.load(std::memory_order_acquire);
  const double until = now() + 0.05;
  while (h->why_ready.load(std::memory_order_acquire) == 0 && now() < until) std::this_thread::yield();
  const std::string why = h->why_ready.load(std::memory_order_acquire) ? std::string(h->why) : "no message";
  throw std::runtime_error("sparsecomm shared-memory all-to-all: rank " + std::to_string(who) +
                           " failed an all-to-all of this group (" + why + "); the group's all-to-all is broken");
}

namespace {

// A walk through a peer's message laid out over segments.
struct Cursor {
  const std::vector<Segment>* segs;
  size_t i = 0;
  int64_t off = 0;
  // Copies the next `len` bytes of the message out of the segments into `dst`.
  void gather(uint8_t* dst, int64_t len) {
    while (len > 0) {
      const Segment& s = (*segs)[i];
      const int64_t take = std::min(len, s.len - off);
      if (take > 0) std::memcpy(dst, reinterpret_cast<const uint8_t*>(s.ptr) + off, take);
      dst += take;
      len -= take;
      off += take;
      if (off == s.len) ++i, off = 0;
    }
  }
  // Copies `len` bytes from `src` into the next bytes of the message's segments.
  void scatter(const uint8_t* src, int64_t len) {
    while (len > 0) {
      const Segment& s = (*segs)[i];
      const int64_t put = std::min(len, s.len - off);
      if (put > 0) std::memcpy(reinterpret_cast<uint8_t*>(s.ptr) + off, src, put);
      src += put;
      len -= put;
      off += put;
      if (off == s.len) ++i, off = 0;
    }
  }
};

int64_t total_bytes(const std::vector<Segment>& segs, bool& bad) {
  int64_t total = 0;
  for (const Segment& s : segs) {
    if (s.len < 0) bad = true;
    total += s.len;
  }
  return total;
}

}  // namespace

void ShmAllToAll::run(const uint8_t* send, const std::vector<int64_t>& ssize, uint8_t* recv,
                      const std::vector<int64_t>& rsize, double timeout_seconds) {
  std::vector<std::vector<Segment>> s(ssize.size()), r(rsize.size());
  uint64_t at = 0;
  for (size_t j = 0; j < ssize.size(); ++j) {
    s[j].push_back({reinterpret_cast<uint64_t>(send) + at, ssize[j]});
    at += static_cast<uint64_t>(std::max<int64_t>(0, ssize[j]));
  }
  at = 0;
  for (size_t j = 0; j < rsize.size(); ++j) {
    r[j].push_back({reinterpret_cast<uint64_t>(recv) + at, rsize[j]});
    at += static_cast<uint64_t>(std::max<int64_t>(0, rsize[j]));
  }
  run_segments(s, r, timeout_seconds);
}

void ShmAllToAll::run_segments(const std::vector<std::vector<Segment>>& send,
                               const std::vector<std::vector<Segment>>& recv, double timeout_seconds) {
  const int n = world_, me = rank_;
  if (failed()) raise_peer_failure();
  // A caller's bad arguments fail the call on every rank too (the peers would otherwise wait for the timeout).
  if (static_cast<int>(send.size()) != n || static_cast<int>(recv.size()) != n)
    fail("rank " + std::to_string(me) + " passed " + std::to_string(send.size()) + "/" +
         std::to_string(recv.size()) + " messages to a shared-memory all-to-all of " + std::to_string(n) + " ranks");
  std::vector<int64_t> ssize(n), rsize(n);
  bool bad = false;
  for (int j = 0; j < n; ++j) {
    ssize[j] = total_bytes(send[j], bad);
    rsize[j] = total_bytes(recv[j], bad);
  }
  if (bad) fail("rank " + std::to_string(me) + " passed a negative size to a shared-memory all-to-all");
  if (ssize[me] != rsize[me])
    fail("rank " + std::to_string(me) + " sends itself " + std::to_string(ssize[me]) + " bytes but expects " +
         std::to_string(rsize[me]));
  std::vector<Cursor> out(n), in(n);
  for (int j = 0; j < n; ++j) {
    out[j].segs = &send[j];
    in[j].segs = &recv[j];
  }
  {  // this rank's own message: segment to segment (the lists may cut it differently)
    Cursor& from = out[me];
    Cursor& to = in[me];
    int64_t left = ssize[me];
    while (left > 0) {
      const Segment& a = send[me][from.i];
      const Segment& b = recv[me][to.i];
      const int64_t len = std::min({left, a.len - from.off, b.len - to.off});
      if (len > 0)
        std::memmove(reinterpret_cast<uint8_t*>(b.ptr) + to.off, reinterpret_cast<const uint8_t*>(a.ptr) + from.off,
                     len);
      left -= len;
      from.off += len;
      to.off += len;
      if (from.off == a.len) ++from.i, from.off = 0;
      if (to.off == b.len) ++to.i, to.off = 0;
    }
  }
  // Per peer: chunks still to post / take (an empty message is one empty chunk: it carries the total, checked).
  std::vector<int64_t> to_send(n, 0), to_take(n, 0), sent_bytes(n, 0), got_bytes(n, 0);
  std::vector<char> first(n, 1);
  int pending = 0;
  for (int j = 0; j < n; ++j) {
    if (j == me) continue;
    to_send[j] = std::max<int64_t>(1, (ssize[j] + slot_ - 1) / slot_);
    to_take[j] = 1;  // at least one; the first chunk's total says how many
    pending += 2;
  }
  const double start = now();
  const double deadline = start + timeout_seconds;
  double next_check = start + kCheckSeconds;
  double idle_since = -1.0;
  const int64_t* pids = reinterpret_cast<const int64_t*>(base_ + pids_);
  std::atomic<uint32_t>& bell = doorbell(me);
  while (pending > 0) {
    const uint32_t seen = bell.load(std::memory_order_seq_cst);
    bool progress = false;
    for (int k = 1; k < n; ++k) {
      const int j = (me + k) % n;  // start with the next rank: ranks do not all hit rank 0 first
      if (to_send[j] > 0) {
        Channel& c = channel(me, j);
        if (c.taken.load(std::memory_order_acquire) == sent_[j]) {
          const int64_t len = std::min<int64_t>(static_cast<int64_t>(slot_), ssize[j] - sent_bytes[j]);
          if (len) out[j].gather(slot(me, j), len);
          c.bytes = static_cast<uint64_t>(len);
          c.total = static_cast<uint64_t>(ssize[j]);
          c.posted.store(++sent_[j], std::memory_order_release);
          sent_bytes[j] += len;
          if (--to_send[j] == 0) --pending;
          ring(j);
          progress = true;
        }
      }
      if (to_take[j] > 0) {
        Channel& c = channel(j, me);
        if (c.posted.load(std::memory_order_acquire) > taken_[j]) {
          const int64_t total = static_cast<int64_t>(c.total), len = static_cast<int64_t>(c.bytes);
          if (total != rsize[j])
            fail("rank " + std::to_string(me) + " expected " + std::to_string(rsize[j]) + " bytes from rank " +
                 std::to_string(j) + ", which sends " + std::to_string(total));
          if (first[j]) {
            first[j] = 0;
            to_take[j] = std::max<int64_t>(1, (total + slot_ - 1) / slot_);
          }
          if (len < 0 || len > static_cast<int64_t>(slot_) || got_bytes[j] + len > rsize[j])
            fail("rank " + std::to_string(me) + " got a malformed chunk from rank " + std::to_string(j));
          if (len) in[j].scatter(slot(j, me), len);
          got_bytes[j] += len;
          c.taken.store(++taken_[j], std::memory_order_release);
          if (--to_take[j] == 0) --pending;
          ring(j);
          progress = true;
        }
      }
    }
    if (progress) {
      idle_since = -1.0;
      continue;
    }
    if (failed()) raise_peer_failure();
    const double t = now();
    if (idle_since < 0) idle_since = t;
    if (spin_ && t - idle_since < kSpinSeconds) continue;
    if (t >= deadline)
      fail("rank " + std::to_string(me) + " waited " + std::to_string(static_cast<int>(t - start)) +
           " s (the group's timeout) for its peers in a shared-memory all-to-all");
    if (t >= next_check) {
      next_check = t + kCheckSeconds;
      for (int j = 0; j < n; ++j) {
        if (j == me || (to_send[j] == 0 && to_take[j] == 0)) continue;
        if (process_alive(pids[j])) continue;
        // Dead, but it may have posted its last chunk before exiting: what it left in the slot still arrives.
        // (Read after the liveness check: a dead process posts nothing more, so this cannot race.)
        if (to_take[j] > 0 && channel(j, me).posted.load(std::memory_order_acquire) > taken_[j]) continue;
        fail("rank " + std::to_string(j) + " (pid " + std::to_string(pids[j]) +
               ") exited during a shared-memory all-to-all with rank " + std::to_string(me));
      }
    }
    // Sleep until a peer rings (or the next check is due).
    const double wait = std::max(1e-4, std::min(next_check, deadline) - t);
    struct timespec ts;
    ts.tv_sec = static_cast<time_t>(wait);
    ts.tv_nsec = static_cast<long>((wait - static_cast<double>(ts.tv_sec)) * 1e9);
    waiters(me).fetch_add(1, std::memory_order_seq_cst);
    ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&bell), FUTEX_WAIT, seen, &ts, nullptr, 0);
    waiters(me).fetch_sub(1, std::memory_order_seq_cst);
  }
}

#else  // not Linux: the Python side never creates one

ShmAllToAll::ShmAllToAll(const std::string&, bool, int, int, uint64_t) {
  throw std::runtime_error("sparsecomm shm: shared-memory all-to-all needs Linux");
}
ShmAllToAll::~ShmAllToAll() {}
void ShmAllToAll::run(const uint8_t*, const std::vector<int64_t>&, uint8_t*, const std::vector<int64_t>&, double) {}
void ShmAllToAll::run_segments(const std::vector<std::vector<Segment>>&, const std::vector<std::vector<Segment>>&,
                               double) {}
bool ShmAllToAll::failed() const { return true; }

#endif

// ---- binding ----

SPARSECOMM_BIND(shm_alltoall) {
  py::class_<ShmAllToAll>(m, "ShmAllToAll")
      .def(py::init<const std::string&, bool, int, int, uint64_t>(), py::arg("path"), py::arg("create"),
           py::arg("rank"), py::arg("world"), py::arg("slot_bytes"),
           "Create (rank 0) or open a host-local all-to-all segment (see sparsecomm/collectives/shm.py).")
      .def("run",
           [](ShmAllToAll& s, uintptr_t send, const std::vector<int64_t>& send_bytes, uintptr_t recv,
              const std::vector<int64_t>& recv_bytes, double timeout_seconds) {
             py::gil_scoped_release release;
             s.run(ptr<const uint8_t>(send), send_bytes, ptr<uint8_t>(recv), recv_bytes, timeout_seconds);
           },
           py::arg("send"), py::arg("send_bytes"), py::arg("recv"), py::arg("recv_bytes"),
           py::arg("timeout_seconds"))
      .def("run_segments",
           [](ShmAllToAll& s, const std::vector<std::vector<std::pair<uint64_t, int64_t>>>& send,
              const std::vector<std::vector<std::pair<uint64_t, int64_t>>>& recv, double timeout_seconds) {
             auto convert = [](const std::vector<std::vector<std::pair<uint64_t, int64_t>>>& lists) {
               std::vector<std::vector<Segment>> out(lists.size());
               for (size_t j = 0; j < lists.size(); ++j)
                 for (const auto& [address, bytes] : lists[j]) out[j].push_back({address, bytes});
               return out;
             };
             const auto s_segs = convert(send), r_segs = convert(recv);
             py::gil_scoped_release release;
             s.run_segments(s_segs, r_segs, timeout_seconds);
           },
           py::arg("send"), py::arg("recv"), py::arg("timeout_seconds"),
           "Per peer, the (address, bytes) pieces of the message it gets / that lands here, in order.")
      .def_property_readonly("failed", &ShmAllToAll::failed)
      .def_property_readonly("bytes", &ShmAllToAll::bytes)
      .def_property_readonly("slot_bytes", &ShmAllToAll::slot_bytes);
}

}  // namespace sparsecomm
