// tally-peer-gloo: the bench's sweep through Gloo (Debian libgloo-dev), one
// process per rank, for tally-bench --compare. Ranks meet through a
// gloo::rendezvous::FileStore in a directory they share (it works across
// network namespaces) and talk over Gloo's tcp transport bound to --host.
// Runs one sweep per algorithm, in order, on one context:
//   ring_chunked      gloo::AllreduceRingChunked
//   halving_doubling  gloo::AllreduceHalvingDoubling
//   allreduce         gloo::allreduce (the ring PyTorch's ProcessGroupGloo calls)
#include <gloo/allreduce.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <vector>

#include "peer_sweep.h"
#include "tally/protocol/split.h"
#include "tally/protocol/version.h"

namespace {

using tally::bench::PeerComm;

// Runs `op`, turning Gloo's exceptions (timeouts, lost peers) into false.
template <typename F>
bool guarded(F&& op, std::string* error) {
  try {
    op();
    return true;
  } catch (const std::exception& e) {
    *error = e.what();
    return false;
  }
}

void sum_doubles(void* c, const void* a, const void* b, size_t n) { gloo::sum<double>(c, a, b, n); }
void sum_floats(void* c, const void* a, const void* b, size_t n) { gloo::sum<float>(c, a, b, n); }

}  // namespace

int main(int argc, char** argv) {
  tally::bench::PeerSweep sweep;
  int rank = 0, size = 1;
  std::string store_dir, host = "127.0.0.1", algorithms = "ring_chunked,halving_doubling,allreduce";
  int timeout_s = 120;
  CLI::App app{"tally-peer-gloo: all-reduce sweeps through Gloo, for tally-bench --compare"};
  app.set_version_flag("--version", "tally-peer-gloo " + tally::version_string());
  tally::bench::add_sweep_options(app, sweep);
  app.add_option("--rank", rank, "this rank")->required();
  app.add_option("--size", size, "number of ranks")->required()->check(CLI::Range(1, 4096));
  app.add_option("--store", store_dir, "directory every rank shares for the rendezvous")
      ->required();
  app.add_option("--host", host, "address the tcp transport binds to")->capture_default_str();
  app.add_option("--algorithms", algorithms, "comma-separated")->capture_default_str();
  app.add_option("--timeout-s", timeout_s, "Gloo's timeout per operation")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  std::vector<std::string> names;
  for (std::string_view n : tally::split_list(algorithms)) names.emplace_back(n);
  if (names.empty()) names.emplace_back();  // refused below, as unknown
  for (const auto& n : names) {
    if (n != "ring_chunked" && n != "halving_doubling" && n != "allreduce") {
      std::fprintf(stderr, "tally-peer-gloo: unknown algorithm '%s'\n", n.c_str());
      return 2;
    }
  }
  // One context (full mesh of connections) per algorithm: a classic
  // algorithm leaves its pairs in a state that slows the unbound-buffer
  // path of gloo::allreduce run after it on the same context by two orders
  // of magnitude (measured: 1 MiB at W=4 took 575 ms instead of 10 ms), so
  // each algorithm starts from fresh connections, as in a fresh process.
  std::shared_ptr<gloo::rendezvous::Context> context;
  auto connect = [&](const std::string& name, std::string* error) {
    return guarded(
        [&] {
          gloo::transport::tcp::attr attr;
          attr.hostname = host;
          auto device = gloo::transport::tcp::CreateDevice(attr);
          gloo::rendezvous::FileStore files(store_dir);
          gloo::rendezvous::PrefixStore store("tally-peer-gloo-" + name, files);
          context.reset();
          context = std::make_shared<gloo::rendezvous::Context>(rank, size);
          context->setTimeout(std::chrono::seconds(timeout_s));
          context->connectFullMesh(store, device);
        },
        error);
  };
  std::string error;
  PeerComm comm;
  comm.rank = static_cast<uint32_t>(rank);
  comm.world = static_cast<uint32_t>(size);
  comm.sum = [&](double* data, size_t count, std::string* err) {
    return guarded(
        [&] {
          gloo::AllreduceOptions opts(context);
          opts.setOutput(data, count);
          opts.setReduceFunction(&sum_doubles);
          opts.setTag(1);
          gloo::allreduce(opts);
        },
        err);
  };
  // The ring bus factor, 2(W-1)/W; halving-doubling moves the same bytes.
  const double busbw = size > 1 ? 2.0 * (size - 1) / size : 1.0;
  int result = 0;
  for (const std::string& name : names) {
    if (!connect(name, &error)) {
      std::fprintf(stderr, "tally-peer-gloo rank %d: rendezvous for %s failed: %s\n", rank,
                   name.c_str(), error.c_str());
      return 2;
    }
    // The classic algorithms bind to one buffer and count when built: one
    // per size, built (and its pairs' buffers registered) before the size's
    // check and timed loop, as Gloo's own benchmark does.
    std::unique_ptr<gloo::Algorithm> algorithm;
    float* bound = nullptr;
    size_t bound_count = 0;
    comm.allreduce = [&](float* data, size_t count, std::string* err) {
      return guarded(
          [&] {
            if (name == "allreduce") {
              gloo::AllreduceOptions opts(context);
              opts.setOutput(data, count);
              opts.setReduceFunction(&sum_floats);
              opts.setTag(2);
              gloo::allreduce(opts);
              return;
            }
            if (!algorithm || bound != data || bound_count != count) {
              algorithm.reset();
              std::vector<float*> ptrs{data};
              if (name == "ring_chunked") {
                algorithm = std::make_unique<gloo::AllreduceRingChunked<float>>(
                    context, ptrs, static_cast<int>(count));
              } else {
                algorithm = std::make_unique<gloo::AllreduceHalvingDoubling<float>>(
                    context, ptrs, static_cast<int>(count));
              }
              bound = data;
              bound_count = count;
            }
            algorithm->run();
          },
          err);
    };
    const int r = tally::bench::run_peer_sweep(sweep, comm, "gloo:" + name, busbw);
    algorithm.reset();
    if (r != 0 && result == 0) result = r;
    if (r == 1) break;
  }
  return result;
}
