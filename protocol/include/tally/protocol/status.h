// Status and Result<T>: how tally reports expected failures (peer lost,
// timeout, malformed input, mismatched contributions, quota). Errors are
// values; exceptions never cross a library boundary. Our own bugs go through
// TALLY_CHECK, which prints its operands and aborts in every build type.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace tally {

// Codes shared with the wire (tally.proto ErrorCode uses the same numbers).
enum class ErrorCode : uint32_t {
  kOk = 0,
  kInvalidArgument = 1,    // the caller passed something unusable
  kProtocol = 2,           // a peer sent a malformed or unexpected frame
  kVersionMismatch = 3,    // a peer speaks another protocol version
  kTimeout = 4,            // a deadline passed
  kPeerLost = 5,           // a connection closed or went silent
  kMismatch = 6,           // contributions to one op disagree
  kResourceExhausted = 7,  // memory budget or quota
  kCancelled = 8,          // shut down while waiting
  kUnavailable = 9,        // could not connect
  kAlreadyExists = 10,     // duplicate rank in a job
  kUnimplemented = 11,     // a valid request this build cannot serve
  kInternal = 12,          // a bug on the other side
  kUnauthenticated = 13,   // a missing or wrong secret
};
// The last ErrorCode value (tables indexed by code have this many + 1 slots).
inline constexpr ErrorCode kLastErrorCode = ErrorCode::kUnauthenticated;

std::string_view error_code_name(ErrorCode code);

class Status {
 public:
  Status() = default;
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return {}; }
  bool is_ok() const { return code_ == ErrorCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "<code name>: <message>", or "ok".
  std::string to_string() const;
  // A copy whose message is prefixed with `context: ` (peer, job, op ...).
  Status with_context(std::string_view context) const;

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

// A value or the Status that explains why there is none.
template <typename T>
class Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {
    if (std::get<Status>(v_).is_ok()) {
      std::fprintf(stderr, "tally: Result constructed from an ok Status\n");
      std::abort();
    }
  }
  bool is_ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return is_ok(); }
  const Status& status() const {
    static const Status kOkStatus;
    return is_ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace tally

#define TALLY_CHECK(cond)                                                                 \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "%s:%d: TALLY_CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)

#define TALLY_CHECK_OP(a, op, b)                                                                  \
  do {                                                                                            \
    const auto& tally_a_ = (a);                                                                   \
    const auto& tally_b_ = (b);                                                                   \
    if (!(tally_a_ op tally_b_)) {                                                                \
      std::fprintf(stderr, "%s:%d: TALLY_CHECK(%s %s %s) failed: %s vs %s\n", __FILE__, __LINE__, \
                   #a, #op, #b, std::to_string(tally_a_).c_str(),                                 \
                   std::to_string(tally_b_).c_str());                                             \
      std::abort();                                                                               \
    }                                                                                             \
  } while (0)
#define TALLY_CHECK_EQ(a, b) TALLY_CHECK_OP(a, ==, b)
#define TALLY_CHECK_LE(a, b) TALLY_CHECK_OP(a, <=, b)
#define TALLY_CHECK_LT(a, b) TALLY_CHECK_OP(a, <, b)

// Propagates a non-ok Status from an expression returning Status.
#define TALLY_RETURN_IF_ERROR(expr)         \
  do {                                      \
    ::tally::Status tally_s_ = (expr);      \
    if (!tally_s_.is_ok()) return tally_s_; \
  } while (0)
