// tally-peer-gloo: the bench's sweep through Gloo (Debian libgloo-dev), one
// process per rank, for tally-bench --compare. Ranks meet through a
// gloo::rendezvous::FileStore in a directory they share (it works across
// network namespaces) and talk over Gloo's tcp transport bound to --host.
// Runs one sweep per algorithm, in order, on one context:
//   ring_chunked      gloo::AllreduceRingChunked
//   halving_doubling  gloo::AllreduceHalvingDoubling
//   allreduce         gloo::allreduce (the ring PyTorch's ProcessGroupGloo calls)
// With --wire float16 each carries the float32 tensor as float16, as DDP's
// fp16_compress_hook sends it over ProcessGroupGloo: the tensor is rounded
// to float16 (round to nearest even), all-reduced in float16 (Gloo's
// float16 sum) and widened back into the caller's buffer, casts timed.
// That is the fair peer of tally's bfloat16 wire: a ring that halves its
// bytes too. Its tables are named NAME-f16 and count the float32 bytes.
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
#include "tally/protocol/kernels.h"
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
void sum_halves(void* c, const void* a, const void* b, size_t n) {
  gloo::sum<gloo::float16>(c, a, b, n);
}

// The settings every algorithm's run shares.
struct GlooSettings {
  int rank = 0;
  int size = 1;
  std::string store_dir;
  std::string host = "127.0.0.1";
  int timeout_s = 120;
  bool half = false;  // --wire float16
};

// One algorithm's sweep on a context of its own. One context (full mesh of
// connections) per algorithm: a classic algorithm leaves its pairs in a
// state that slows the unbound-buffer path of gloo::allreduce run after it
// on the same context by two orders of magnitude (measured: 1 MiB at W=4
// took 575 ms instead of 10 ms), so each algorithm starts from fresh
// connections, as in a fresh process.
class GlooRun {
 public:
  GlooRun(const GlooSettings& settings, std::string name)
      : settings_(settings), name_(std::move(name)) {}
  ~GlooRun() { algorithm_.reset(); }  // before its context

  bool connect(std::string* error) {
    return guarded(
        [&] {
          gloo::transport::tcp::attr attr;
          attr.hostname = settings_.host;
          auto device = gloo::transport::tcp::CreateDevice(attr);
          gloo::rendezvous::FileStore files(settings_.store_dir);
          gloo::rendezvous::PrefixStore store("tally-peer-gloo-" + name_, files);
          context_ = std::make_shared<gloo::rendezvous::Context>(settings_.rank, settings_.size);
          context_->setTimeout(std::chrono::seconds(settings_.timeout_s));
          context_->connectFullMesh(store, device);
        },
        error);
  }

  // The sweep's own barrier and result sums.
  bool sum(double* data, size_t count, std::string* error) {
    return guarded(
        [&] {
          gloo::AllreduceOptions opts(context_);
          opts.setOutput(data, count);
          opts.setReduceFunction(&sum_doubles);
          opts.setTag(1);
          gloo::allreduce(opts);
        },
        error);
  }

  // The algorithm under test, on the float32 tensor `data`: in float32, or
  // (--wire float16) through a float16 copy.
  bool allreduce(float* data, size_t count, std::string* error) {
    return guarded(
        [&] {
          if (!settings_.half) return run(data, count, &sum_floats);
          half_.resize(count);
          auto* wire = reinterpret_cast<uint16_t*>(half_.data());
          tally::kernels().narrow_f16(wire, data, count);
          run(half_.data(), count, &sum_halves);
          tally::kernels().widen_f16(data, wire, count);
        },
        error);
  }

 private:
  // The classic algorithms bind to one buffer and count when built: one per
  // size, built (and its pairs' buffers registered) before the size's check
  // and timed loop, as Gloo's own benchmark does.
  template <typename T>
  void run(T* data, size_t count, void (*reduce)(void*, const void*, const void*, size_t)) {
    if (name_ == "allreduce") {
      gloo::AllreduceOptions opts(context_);
      opts.setOutput(data, count);
      opts.setReduceFunction(reduce);
      opts.setTag(2);
      gloo::allreduce(opts);
      return;
    }
    if (!algorithm_ || bound_ != data || bound_count_ != count) {
      algorithm_.reset();
      std::vector<T*> ptrs{data};
      if (name_ == "ring_chunked") {
        algorithm_ = std::make_unique<gloo::AllreduceRingChunked<T>>(context_, ptrs,
                                                                     static_cast<int>(count));
      } else {
        algorithm_ = std::make_unique<gloo::AllreduceHalvingDoubling<T>>(context_, ptrs,
                                                                         static_cast<int>(count));
      }
      bound_ = data;
      bound_count_ = count;
    }
    algorithm_->run();
  }

  const GlooSettings& settings_;
  const std::string name_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::unique_ptr<gloo::Algorithm> algorithm_;
  const void* bound_ = nullptr;
  size_t bound_count_ = 0;
  std::vector<gloo::float16> half_;  // --wire float16: the tensor as sent
};

}  // namespace

int main(int argc, char** argv) {
  tally::bench::PeerSweep sweep;
  GlooSettings settings;
  std::string algorithms = "ring_chunked,halving_doubling,allreduce";
  CLI::App app{"tally-peer-gloo: all-reduce sweeps through Gloo, for tally-bench --compare"};
  app.set_version_flag("--version", "tally-peer-gloo " + tally::version_string());
  tally::bench::add_sweep_options(app, sweep);
  app.add_option("--rank", settings.rank, "this rank")->required();
  app.add_option("--size", settings.size, "number of ranks")
      ->required()
      ->check(CLI::Range(1, 4096));
  app.add_option("--store", settings.store_dir, "directory every rank shares for the rendezvous")
      ->required();
  app.add_option("--host", settings.host, "address the tcp transport binds to")
      ->capture_default_str();
  app.add_option("--algorithms", algorithms, "comma-separated")->capture_default_str();
  app.add_option("--timeout-s", settings.timeout_s, "Gloo's timeout per operation")
      ->capture_default_str();
  std::string wire = "float32";
  app.add_option("--wire", wire,
                 "float32, or float16: the float32 tensor is carried as float16 (DDP's "
                 "fp16_compress_hook)")
      ->check(CLI::IsMember({"float32", "float16"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  settings.half = wire == "float16";
  if (settings.half && settings.size > 64) {
    std::fprintf(stderr,
                 "tally-peer-gloo: --wire float16 runs up to 64 ranks (the checked sums pass "
                 "float16's largest value beyond)\n");
    return 2;
  }

  std::vector<std::string> names;
  for (std::string_view n : tally::split_list(algorithms)) names.emplace_back(n);
  if (names.empty()) names.emplace_back();  // refused below, as unknown
  for (const auto& n : names) {
    if (n != "ring_chunked" && n != "halving_doubling" && n != "allreduce") {
      std::fprintf(stderr, "tally-peer-gloo: unknown algorithm '%s'\n", n.c_str());
      return 2;
    }
  }
  // The ring bus factor, 2(W-1)/W; halving-doubling moves the same bytes.
  const double busbw = settings.size > 1 ? 2.0 * (settings.size - 1) / settings.size : 1.0;
  int result = 0;
  for (const std::string& name : names) {
    GlooRun run(settings, name);
    std::string error;
    if (!run.connect(&error)) {
      std::fprintf(stderr, "tally-peer-gloo rank %d: rendezvous for %s failed: %s\n", settings.rank,
                   name.c_str(), error.c_str());
      return 2;
    }
    PeerComm comm;
    comm.rank = static_cast<uint32_t>(settings.rank);
    comm.world = static_cast<uint32_t>(settings.size);
    comm.sum = [&run](double* data, size_t count, std::string* err) {
      return run.sum(data, count, err);
    };
    comm.allreduce = [&run](float* data, size_t count, std::string* err) {
      return run.allreduce(data, count, err);
    };
    // Each of the ring's W - 1 additions, and the rounding of each input,
    // may be off by float16's unit roundoff (2^-11); pattern.h's sums stay
    // below float16's largest finite value for W <= 64.
    if (settings.half) comm.relative_error = (settings.size + 1) * 0x1p-11;
    const std::string table = "gloo:" + name + (settings.half ? "-f16" : "");
    const int r = tally::bench::run_peer_sweep(sweep, comm, table, busbw);
    if (r != 0 && result == 0) result = r;
    if (r == 1) break;
  }
  return result;
}
