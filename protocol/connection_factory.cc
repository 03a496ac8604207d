#include "tally/protocol/connection_factory.h"

#include <string>

#include "tally/protocol/fabric_transport.h"
#include "tally/protocol/tcp_transport.h"

namespace tally {

std::shared_ptr<Connection> make_connection(const std::shared_ptr<Fabric>& fabric,
                                            boost::asio::ip::tcp::socket socket,
                                            const ConnectionOptions& options) {
  return fabric ? fabric->make_connection(std::move(socket), options)
                : make_tcp_connection(std::move(socket), options);
}

std::shared_ptr<Connection> Fabric::make_connection(boost::asio::ip::tcp::socket socket,
                                                    const ConnectionOptions& options) {
  // Read before the socket moves into the control stream.
  boost::system::error_code ec;
  auto local = socket.local_endpoint(ec);
  std::string ip = ec ? std::string() : local.address().to_string();
  auto control = make_tcp_connection(std::move(socket), options);
  return wrap_control(std::move(control), std::move(ip), options);
}

}  // namespace tally
