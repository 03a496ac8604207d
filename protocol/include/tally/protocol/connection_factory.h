// Where a connected socket becomes a Connection: the one place that knows
// both transports, so that neither has to include the other.
#pragma once

#include <boost/asio/ip/tcp.hpp>
#include <memory>

#include "tally/protocol/transport.h"

namespace tally {

class Fabric;

// Wraps a connected socket: through `fabric` when there is one (the data
// path then follows the handshake), else as a plain TCP connection. The one
// place workers, reducers and replica links choose their transport. The
// connection lives on the socket's executor; the caller owns it (shared).
// Non-blocking; never fails (a dead socket shows as on_closed after start()).
std::shared_ptr<Connection> make_connection(const std::shared_ptr<Fabric>& fabric,
                                            boost::asio::ip::tcp::socket socket,
                                            const ConnectionOptions& options);

}  // namespace tally
