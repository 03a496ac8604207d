// What the live-session fuzz targets share: real reducers of this process,
// started once, and a loopback stream to one of them that plays a peer
// (docs/fuzzing.md, "Live sessions").
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "tally.pb.h"
#include "tally/protocol/address.h"
#include "tally/protocol/auth.h"
#include "tally/protocol/frame.h"

namespace tally::fuzz {

// The secrets the fuzzing reducers hold; the harness uses them to answer an
// AuthChallenge, so authenticated paths are reached, not just refused.
const Secret& job_secret();
const Secret& pool_secret();

// The address of a reducer with one group (worker streams), started on the
// first call and left running until the process exits: shard 0 of 1, a
// job secret (authentication optional), small buffers, short timeouts.
// Aborts if it cannot start. Thread-safe.
HostPort worker_reducer();

// The address of group 0 of a pool of two replica groups (shard 0 of 1),
// both reducers of this process, linked to each other, with a pool secret.
// Started on the first call (waits, bounded, for the link to come up).
HostPort replica_reducer();

// The payload of a control frame: its 64-byte header, then the message.
std::string control_frame(const wire::Control& message);
// A control frame of `payload` as it is, whatever it holds.
std::string control_frame(std::span<const uint8_t> payload);

// One loopback TCP stream to a reducer, as a peer that reads everything it
// is sent. Every call has a deadline; none throws. Closes on destruction.
class Stream {
 public:
  // Connects, or aborts (the reducer is local: a refusal is a harness bug).
  explicit Stream(const HostPort& address);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  // Writes `bytes`, reading (and dropping) whatever arrives meanwhile, so a
  // reducer that answers while we write never blocks on us. False when the
  // reducer closed the stream first or the deadline passed.
  bool write(std::string_view bytes, std::chrono::steady_clock::time_point deadline);
  // The next control message other than a Heartbeat, or nullopt on the
  // stream's end, a malformed frame or the deadline.
  std::optional<wire::Control> read_control(std::chrono::steady_clock::time_point deadline);
  // Half-closes (the reducer reads its end of input), then reads until the
  // reducer closes the stream; false if it has not by the deadline.
  bool finish(std::chrono::steady_clock::time_point deadline);

 private:
  // Reads what is there (waiting up to the deadline for something); false
  // on the stream's end or error.
  bool read_some(std::chrono::steady_clock::time_point deadline, std::string* into);

  int fd_ = -1;
  bool eof_ = false;
  std::string pending_;  // read, not yet taken by read_control
};

// One input of a live target: opens a stream to `address`, sends what
// `send_prefix(stream, mode, deadline)` sends for the mode byte data[0] (it
// returns false if the reducer did not take it), then data[1..] (raw, or
// with mode & 4 as the payload of one control frame), half-closes, and
// aborts unless the reducer closes the stream within kStreamDeadline.
using SendPrefix = bool (*)(Stream& stream, uint8_t mode,
                            std::chrono::steady_clock::time_point deadline);
void run_live_input(const HostPort& address, const uint8_t* data, size_t size,
                    SendPrefix send_prefix);

// How long a stream may take before the harness calls the reducer stuck:
// far above the reducers' op and hello timeouts (1 s), below libFuzzer's
// -timeout.
inline constexpr std::chrono::seconds kStreamDeadline{10};

}  // namespace tally::fuzz
