// All-to-all between processes of one host through a shared memory segment.
//
// gloo moves an all-to-all through TCP sockets and two helper threads per
// process; on a busy host each hand-off waits for a core, so a small
// all-to-all costs far more than its copying. Here every ordered pair of ranks (src, dst) has a
// channel: one slot of `slot_bytes` that src fills and dst empties, with two
// counters (chunks posted, chunks taken) that only ever grow, so a channel
// never needs resetting between calls. A message larger than a slot goes
// chunk by chunk; every rank sends and receives to and from all peers in one
// loop, so no order of peers can deadlock. A rank with nothing to do sleeps on
// its doorbell (a futex in the segment) that peers ring after each post/take.
//
// Failure is never a hang: a wait gives up after the group's timeout, checks
// every 100 ms whether the peers it waits for still exist, and the first rank
// to fail marks the segment failed, which every peer sees at once and raises
// (the segment is then unusable: the caller falls back to nothing, it raises).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace sparsecomm {

// A piece of a message: `len` bytes at address `ptr`.
struct Segment {
  uint64_t ptr;
  int64_t len;
};

class ShmAllToAll {
 public:
  // Creates (rank 0: `create`) or opens the segment at `path` (a /dev/shm file).
  ShmAllToAll(const std::string& path, bool create, int rank, int world, uint64_t slot_bytes);
  ~ShmAllToAll();
  ShmAllToAll(const ShmAllToAll&) = delete;
  ShmAllToAll& operator=(const ShmAllToAll&) = delete;

  // One all-to-all: send[sdispl[j], +ssize[j]) goes to rank j, which receives it in
  // recv[rdispl[me], +rsize[me]). Sizes in bytes; both sides' sizes must agree
  // (checked: a mismatch fails the call on every rank). Blocks until this
  // rank has received everything and posted everything it sends.
  void run(const uint8_t* send, const std::vector<int64_t>& ssize, uint8_t* recv,
           const std::vector<int64_t>& rsize, double timeout_seconds);

  // The same with each peer's message gathered from / scattered to a list of segments (send[j]: what goes
  // to rank j, in order; recv[j]: where rank j's message lands), so that rows go between tensors and the
  // slots without a staging buffer.
  void run_segments(const std::vector<std::vector<Segment>>& send, const std::vector<std::vector<Segment>>& recv,
                    double timeout_seconds);

  int rank() const { return rank_; }
  int world() const { return world_; }
  uint64_t slot_bytes() const { return slot_; }
  uint64_t bytes() const { return size_; }
  bool failed() const;

  // The segment's layout (shared with other processes; defined in the .cpp).
  struct Channel;
  struct Header;

 private:
  Channel& channel(int src, int dst) const;
  uint8_t* slot(int src, int dst) const;
  std::atomic<uint32_t>& doorbell(int r) const;
  std::atomic<uint32_t>& waiters(int r) const;
  void ring(int r) const;
  [[noreturn]] void fail(const std::string& why);
  [[noreturn]] void raise_peer_failure() const;

  int rank_, world_;
  uint64_t slot_, size_ = 0;
  size_t pids_ = 0, bells_ = 0, channels_ = 0, slots_ = 0;   // offsets in the segment
  uint8_t* base_ = nullptr;
  int fd_ = -1;
  bool spin_;                       // spin briefly before sleeping (only when every rank can have a core)
  std::vector<uint64_t> sent_, taken_;   // chunks this rank posted to / took from each peer, all calls
};

}  // namespace sparsecomm
