#include "hostiles.h"

#include <cinttypes>
#include <cstdio>

#include "tally/bench/metrics_scrape.h"

namespace tally::bench {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

Result<std::unique_ptr<Hostiles>> Hostiles::start(const HostileOptions& options, LocalPool& pool) {
  std::unique_ptr<Hostiles> h(new Hostiles(options, pool));
  h->in_a_row_.assign(pool.addresses().size(), 0);
  if (options.liar) {
    auto secret = load_secret(options.secret_file, nullptr, "job secret");
    if (!secret) return secret.status();
    Liar::Options lo;
    lo.rank0_address = pool.addresses()[0];
    lo.two_groups = pool.groups() > 1;
    lo.rank1_address = pool.addresses()[lo.two_groups ? pool.shards() : 0];
    lo.secret = *secret;
    lo.job_prefix = options.job_prefix;
    lo.op_timeout_ms = options.op_timeout_ms;
    h->liar_ = std::make_unique<Liar>(std::move(lo));
  }
  if (options.slow_http > 0) {
    h->slow_ = std::make_unique<SlowHttpClients>(
        pool.http_addresses(), SlowHttpClients::sources(options.slow_http), options.limit);
  }
  return h;
}

void Hostiles::probe(Clock::time_point now) {
  if (now < next_probe_) return;
  next_probe_ = now + std::chrono::seconds(1);
  const std::vector<std::string>& http = pool_.http_addresses();
  for (size_t i = 0; i < http.size(); ++i) {
    probes_++;
    auto answer = http_get(http[i], "/healthz", milliseconds(1000));
    if (answer) {
      in_a_row_[i] = 0;
      continue;
    }
    unanswered_++;
    last_unanswered_ = "reducer " + std::to_string(i) + ": " + answer.status().message();
    most_in_a_row_ = std::max(most_in_a_row_, ++in_a_row_[i]);
  }
}

void Hostiles::restarted(uint32_t index) {
  in_a_row_[index] = 0;
  if (slow_) slow_->set_addresses(pool_.http_addresses());
}

int Hostiles::finish() {
  const int cut = slow_ ? slow_->cut() : 0;
  slow_.reset();
  const Liar::Counts liar = liar_ ? liar_->counts() : Liar::Counts{};
  liar_.reset();
  int verdict = 0;
  std::printf("# probes: %" PRIu64 " of /healthz (1 s timeout), %" PRIu64
              " unanswered, at most %u in a row%s%s\n",
              probes_, unanswered_, most_in_a_row_, unanswered_ ? "; last: " : "",
              last_unanswered_.c_str());
  if (most_in_a_row_ >= 3) verdict = 1;  // a liveness probe would have restarted it
  if (options_.slow_http > 0) {
    std::printf("# slow HTTP clients: %u dripping requests from %u sources, %d connections cut\n",
                options_.slow_http,
                std::min<uint32_t>(options_.slow_http, SlowHttpClients::kDistinctSources), cut);
  }
  if (options_.liar) {
    std::printf("# liar: a job of 2 ranks (%s), %" PRIu64
                " ops exact, each followed by the lie that every rank has the results below "
                "2^40; %" PRIu64 " wrong; %" PRIu64 " incarnations",
                pool_.groups() > 1 ? "one in each of groups 0 and 1" : "both in group 0", liar.ops,
                liar.wrong, liar.jobs);
    for (auto& [kind, count] : liar.failures) {
      std::printf("%s %s %" PRIu64, kind == liar.failures.begin()->first ? ", ended by:" : ",",
                  kind.c_str(), count);
    }
    std::printf("%s%s\n", liar.example.empty() ? "" : "; e.g. ", liar.example.c_str());
    if (liar.ops == 0 || liar.stalls() > 0) verdict = 1;
    if (liar.wrong > 0) verdict = 3;
  }
  std::fflush(stdout);
  return verdict;
}

}  // namespace tally::bench
