#include "tally/protocol/status.h"

namespace tally {

std::string_view error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk:
      return "ok";
    case ErrorCode::kInvalidArgument:
      return "invalid_argument";
    case ErrorCode::kProtocol:
      return "protocol_error";
    case ErrorCode::kVersionMismatch:
      return "version_mismatch";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kPeerLost:
      return "peer_lost";
    case ErrorCode::kMismatch:
      return "mismatch";
    case ErrorCode::kResourceExhausted:
      return "resource_exhausted";
    case ErrorCode::kCancelled:
      return "cancelled";
    case ErrorCode::kUnavailable:
      return "unavailable";
    case ErrorCode::kAlreadyExists:
      return "already_exists";
    case ErrorCode::kUnimplemented:
      return "unimplemented";
    case ErrorCode::kInternal:
      return "internal";
    case ErrorCode::kUnauthenticated:
      return "unauthenticated";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  std::string out(error_code_name(code_));
  out += ": ";
  out += message_;
  return out;
}

Status Status::with_context(std::string_view context) const {
  if (is_ok()) return *this;
  std::string message(context);
  message += ": ";
  message += message_;
  return Status(code_, std::move(message));
}

}  // namespace tally
