// The fabric transport's process-wide object: the provider chosen at
// start-up and the endpoints by (I/O context, local address). The object
// tree is described in tally/protocol/fabric_transport.h.
#include <spdlog/spdlog.h>

#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "connection.h"
#include "endpoint.h"
#include "libfabric.h"
#include "tally/protocol/fabric_transport.h"

namespace tally {

bool fabric_available() { return true; }

namespace {

using fabric::Endpoint;
using fabric::FabricConnection;
using fabric::InfoPtr;
namespace asio = boost::asio;

// The process-wide side: the provider choice and the endpoints by
// (I/O context, local address).
class FabricImpl final : public Fabric, public std::enable_shared_from_this<FabricImpl> {
 public:
  FabricImpl(FabricOptions options, InfoPtr probe) : options_(std::move(options)) {
    info_.provider =
        probe->fabric_attr->prov_name ? probe->fabric_attr->prov_name : options_.provider;
    info_.fabric = probe->fabric_attr->name ? probe->fabric_attr->name : "";
    info_.domain = probe->domain_attr->name ? probe->domain_attr->name : "";
    info_.registration = fabric::needs_registration(options_, probe.get());
  }
  ~FabricImpl() override { close(); }

  FabricInfo info() const override { return info_; }
  const FabricOptions& options() const { return options_; }

  std::shared_ptr<Connection> wrap_control(std::shared_ptr<Connection> control,
                                           std::string local_ip,
                                           const ConnectionOptions& options) override;

  Status prepare_endpoint(asio::any_io_executor executor, const std::string& local_ip) override {
    auto ep = endpoint_for(executor, local_ip);
    return ep ? Status::ok() : ep.status();
  }

  // Opens (blocking, up to about a second) or reuses the endpoint for this
  // executor's context and local address. Thread-safe.
  Result<std::shared_ptr<Endpoint>> endpoint_for(asio::any_io_executor executor,
                                                 const std::string& node) {
    void* ctx = &asio::query(executor, asio::execution::context);
    std::lock_guard lock(mu_);
    if (closed_) return Status(ErrorCode::kCancelled, "fabric closed");
    auto key = std::make_pair(ctx, node);
    if (auto it = endpoints_.find(key); it != endpoints_.end()) return it->second;
    auto ep = Endpoint::open(options_, node, executor);
    if (!ep) return ep.status();
    endpoints_.emplace(key, *ep);
    spdlog::info(
        "fabric endpoint open: provider {}, fabric {}, domain {}, bound to {}, registration {}, "
        "max message {} bytes",
        (*ep)->provider(), (*ep)->fabric_name(), (*ep)->domain_name(),
        node.empty() ? "(provider default)" : node, (*ep)->registration() ? "on" : "off",
        (*ep)->max_msg_size());
    return *ep;
  }

  void close() override;

  // Every connection made, so close() can break the cycles of those still
  // waiting for libfabric (owner <-> connection <-> TCP side).
  void track(const std::shared_ptr<FabricConnection>& conn) {
    std::lock_guard lock(mu_);
    std::erase_if(connections_, [](const auto& w) { return w.expired(); });
    connections_.push_back(conn);
  }

 private:
  FabricOptions options_;
  FabricInfo info_;
  std::mutex mu_;
  bool closed_ = false;
  std::map<std::pair<void*, std::string>, std::shared_ptr<Endpoint>> endpoints_;
  std::vector<std::weak_ptr<FabricConnection>> connections_;
};

void FabricImpl::close() {
  std::map<std::pair<void*, std::string>, std::shared_ptr<Endpoint>> eps;
  std::vector<std::weak_ptr<FabricConnection>> conns;
  {
    std::lock_guard lock(mu_);
    closed_ = true;
    eps.swap(endpoints_);
    conns.swap(connections_);
  }
  for (auto& [key, ep] : eps) ep->close();
  for (auto& w : conns) {
    if (auto c = w.lock()) c->abandon();
  }
}

std::shared_ptr<Connection> FabricImpl::wrap_control(std::shared_ptr<Connection> control,
                                                     std::string local_ip,
                                                     const ConnectionOptions& options) {
  auto executor = control->executor();
  FabricConnection::EndpointSource source = [self = shared_from_this(), executor,
                                             ip = std::move(local_ip)] {
    return self->endpoint_for(executor, ip);
  };
  auto conn = std::make_shared<FabricConnection>(std::move(control), std::move(source), options);
  track(conn);
  return conn;
}

}  // namespace

Result<std::shared_ptr<Fabric>> Fabric::open(const FabricOptions& options) {
  auto probe = fabric::get_info(options.provider, "", fabric::kTagBitsUsed);
  if (!probe) return probe.status();
  return std::shared_ptr<Fabric>(std::make_shared<FabricImpl>(options, std::move(*probe)));
}

}  // namespace tally
