/* One rank of an all-reduce through the C API (tally::c, or pkg-config's
 * tally), named by TALLY_* in the environment; as consumer.cc. */
#include <stdio.h>
#include <stdlib.h>

#include "tally/tally.h"

int main(void) {
  tally_options* options = NULL;
  tally_client* client = NULL;
  if (tally_options_from_env(&options) != TALLY_OK ||
      tally_client_connect(options, &client) != TALLY_OK) {
    fprintf(stderr, "%s\n", tally_last_error());
    return 1;
  }
  const float w = (float)tally_client_world_size(client);
  float data[4096];
  for (int i = 0; i < 4096; ++i) data[i] = (float)(tally_client_rank(client) + 1);
  if (tally_allreduce(client, data, 4096, TALLY_FLOAT32, TALLY_SUM) != TALLY_OK) {
    fprintf(stderr, "%s\n", tally_last_error());
    return 1;
  }
  for (int i = 0; i < 4096; ++i) {
    if (data[i] != w * (w + 1) / 2) {
      fprintf(stderr, "wrong: %g\n", data[i]);
      return 1;
    }
  }
  tally_client_destroy(client);
  tally_options_destroy(options);
  puts("ok");
  return 0;
}
