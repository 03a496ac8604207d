// One rank of an all-reduce through the C++ client (tally::client), named by
// TALLY_* in the environment: every element of rank r is r + 1, so the sum
// over W ranks is W (W + 1) / 2. Prints "ok" and exits 0 when it is.
#include <cstdio>
#include <vector>

#include "tally/client/client.h"

int main() {
  auto options = tally::client_options_from_env();
  if (!options) return std::fprintf(stderr, "%s\n", options.status().to_string().c_str()), 1;
  auto client = tally::Client::connect(*options);
  if (!client) return std::fprintf(stderr, "%s\n", client.status().to_string().c_str()), 1;
  const float w = static_cast<float>(options->world_size);
  std::vector<float> data(4096, static_cast<float>(options->rank + 1));
  tally::Status s =
      (*client)->allreduce(data.data(), data.size(), tally::DType::kFloat32, tally::RedOp::kSum);
  if (!s) return std::fprintf(stderr, "%s\n", s.to_string().c_str()), 1;
  for (float v : data) {
    if (v != w * (w + 1) / 2) return std::fprintf(stderr, "wrong: %g\n", v), 1;
  }
  std::puts("ok");
  return 0;
}
