#include "tally/protocol/control.h"

#include <google/protobuf/stubs/logging.h>
#include <spdlog/spdlog.h>

#include <limits>

namespace tally {
namespace {

void protobuf_log(google::protobuf::LogLevel level, const char* file, int line,
                  const std::string& message) {
  if (level == google::protobuf::LOGLEVEL_FATAL) {
    spdlog::critical("protobuf ({}:{}): {}", file, line, message);
  } else {
    spdlog::debug("protobuf ({}:{}): {}", file, line, message);
  }
}

}  // namespace

void route_protobuf_logs() { google::protobuf::SetLogHandler(&protobuf_log); }

std::string utf8_prefix(std::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return std::string(text);
  size_t end = max_bytes;
  // Back off continuation bytes (10xxxxxx) to the start of the cut character.
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  return std::string(text.substr(0, end));
}

Result<wire::Control> parse_control(std::span<const std::byte> payload) {
  wire::Control message;
  // kMaxControlBytes (frame.h) bounds a payload far below INT_MAX.
  if (payload.size() > static_cast<size_t>(std::numeric_limits<int>::max()) ||
      !message.ParseFromArray(payload.data(), static_cast<int>(payload.size())) ||
      message.body_case() == wire::Control::BODY_NOT_SET) {
    return Status(ErrorCode::kProtocol, "malformed control message");
  }
  return message;
}

wire::Control make_error(const Status& status, std::optional<uint64_t> op,
                         const std::vector<uint32_t>& ranks) {
  wire::Control message;
  wire::Error* error = message.mutable_error();
  error->set_code(static_cast<wire::ErrorCode>(status.code()));
  error->set_message(status.message());
  if (op) {
    error->set_has_op(true);
    error->set_op(*op);
  }
  for (uint32_t rank : ranks) error->add_ranks(rank);
  return message;
}

Status status_from_error(const wire::Error& error) {
  auto code = static_cast<ErrorCode>(error.code());
  if (code == ErrorCode::kOk ||
      static_cast<uint32_t>(code) > static_cast<uint32_t>(kLastErrorCode)) {
    code = ErrorCode::kInternal;
  }
  return Status(code, error.message());
}

}  // namespace tally
