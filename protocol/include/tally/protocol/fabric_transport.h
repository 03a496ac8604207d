// libfabric transport: the data path over reliable-datagram (FI_EP_RDM)
// endpoints with tagged messages; control stays on a TCP stream.
//
// Object tree (Gloo's device -> pair shape):
//   Fabric            one per process: the provider chosen at start-up
//   └ endpoint        one per (I/O thread, local IP): domain, CQ, AV, RDM
//                     endpoint, memory-registration cache; driven only from
//                     its I/O thread
//     └ connection    one per peer stream: a Connection whose control frames,
//                     heartbeats and liveness ride on the TCP socket it wraps,
//                     and whose data frames ride on the endpoint once both
//                     sides have exchanged fabric addresses over that socket
//                     (Hello / Welcome data_path).
//
// A data frame is two tagged messages: the 64-byte header (tag: its
// sequence number on the stream, so headers are taken in order whatever the
// provider's ordering) and the payload (tag: kind, op, chunk and fragment, so a
// receiver can post it ahead into its final place). See docs/protocol.md.
#pragma once

#include <boost/asio/ip/tcp.hpp>
#include <memory>
#include <string>

#include "tally/protocol/transport.h"

namespace tally {

struct FabricOptions {
  // libfabric provider name, e.g. "tcp;ofi_rxm" (the default), "verbs;ofi_rxm", "efa".
  std::string provider = "tcp;ofi_rxm";
  // Register every buffer even where the provider does not ask for it
  // (mr_mode without FI_MR_LOCAL), so the registration path is exercised
  // on machines without RDMA hardware.
  bool force_registration = false;
  // Split payloads into messages of at most this many bytes even where the
  // provider's max_msg_size allows more (0: the provider's limit). Lets
  // tests exercise splitting on providers whose limit is huge.
  size_t max_msg_bytes = 0;
};

// True when this build has the libfabric transport (CMake TALLY_WITH_FABRIC).
bool fabric_available();

// What was opened, for logs and the bench header.
struct FabricInfo {
  std::string provider;       // e.g. "tcp;ofi_rxm"
  std::string fabric;         // e.g. "127.0.0.1/32"
  std::string domain;         // e.g. "lo"
  bool registration = false;  // buffers are registered (provider asks, or forced)
};

class Fabric {
 public:
  // Checks that the provider exists here (fi_getinfo), without opening
  // endpoints yet. Blocks for up to a second. Errors: kUnavailable naming
  // the provider and libfabric's reason; kUnimplemented in a build without
  // libfabric.
  static Result<std::shared_ptr<Fabric>> open(const FabricOptions& options);
  virtual ~Fabric() = default;

  virtual FabricInfo info() const = 0;

  // Wraps a connected socket as a Connection that starts with its data path
  // on TCP and moves data onto this fabric when attach_data_path() is given
  // a fabric description (the reducer, answering a Hello) or when it offers
  // one through describe_data_path() (the client, before its Hello). The
  // connection lives on the socket's executor, which must belong to an
  // io_context that outlives close(). Non-blocking; never fails (a dead
  // socket shows as on_closed). Defined in connection_factory.cc, beside
  // make_connection(): the socket becomes a TCP control stream there and is
  // handed to wrap_control(), so that this transport never includes the TCP one.
  std::shared_ptr<Connection> make_connection(boost::asio::ip::tcp::socket socket,
                                              const ConnectionOptions& options);

  // Builds the fabric connection around `control`, a stream not started yet
  // that carries control frames (and data frames until the data path moves
  // onto the fabric); the connection owns it from here on. `local_ip` is
  // the address its socket is bound to ("" when unknown), which chooses the
  // endpoint. Same threading and lifetime rules as make_connection().
  virtual std::shared_ptr<Connection> wrap_control(std::shared_ptr<Connection> control,
                                                   std::string local_ip,
                                                   const ConnectionOptions& options) = 0;

  // Opens now the endpoint that connections on `executor` whose control
  // socket is bound to `local_ip` will use, instead of at the first such
  // connection (which would block that I/O thread for up to a second).
  // Thread-safe; blocks. Errors: as for open().
  virtual Status prepare_endpoint(boost::asio::any_io_executor executor,
                                  const std::string& local_ip) = 0;

  // Closes every endpoint and drops operations the provider never finished
  // (sends to dead peers). Call after the I/O threads have stopped and
  // before their io_contexts are destroyed. Idempotent.
  virtual void close() = 0;
};

}  // namespace tally
