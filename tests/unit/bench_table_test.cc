// The bench's one row format and its parser (tally-bench's worker and the
// peers write it; the driver reads it back for --compare), and tc rates.
#include <gtest/gtest.h>

#include "tally/bench/netlab.h"
#include "tally/bench/table.h"
#include "tally/protocol/link_rate.h"

namespace tally::bench {
namespace {

TEST(BenchTable, RowsRoundTripAndOtherLinesAreSkipped) {
  TableRow a{1048576, 262144, "float", "sum", 1234.5, 0.85, 1.275, 0};
  TableRow b{4096, 1024, "float", "sum", 20.0, 0.205, 0.205, 3};
  const std::string text = "# tally-bench ...\n" + table_header() + format_row(a) +
                           // A byte-report row (numbers where the type goes): not a table row.
                           "     1048576   0   0   4       524288       524288            0 |\n" +
                           format_row(b) + "# Out of bounds values : 0 OK\n";
  const auto rows = parse_rows(text);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].bytes, 1048576u);
  EXPECT_EQ(rows[0].count, 262144u);
  EXPECT_EQ(rows[0].type, "float");
  EXPECT_EQ(rows[0].redop, "sum");
  EXPECT_DOUBLE_EQ(rows[0].time_us, 1234.5);
  EXPECT_DOUBLE_EQ(rows[0].algbw, 0.85);
  EXPECT_DOUBLE_EQ(rows[0].busbw, 1.275);
  EXPECT_EQ(rows[1].bytes, 4096u);
  EXPECT_DOUBLE_EQ(rows[1].wrong, 3);
}

TEST(BenchTable, TablesAreSplitByTheirNameLines) {
  TableRow r{65536, 16384, "float", "sum", 10, 6.5, 6.5, 0};
  const std::string text = format_row(r) + "# table gloo:ring_chunked W=4\n" + table_header() +
                           format_row(r) + format_row(r) + "# table mpi W=4\n" +
                           "# table empty W=4\n" + format_row(r);
  const auto tables = parse_tables(text, "tally");
  ASSERT_EQ(tables.size(), 3u);
  EXPECT_EQ(tables[0].name, "tally");
  EXPECT_EQ(tables[0].rows.size(), 1u);
  EXPECT_EQ(tables[1].name, "gloo:ring_chunked");
  EXPECT_EQ(tables[1].rows.size(), 2u);
  EXPECT_EQ(tables[2].name, "empty");  // "mpi" had no rows
}

TEST(BenchTable, HumanBytes) {
  EXPECT_EQ(human_bytes(1u << 20), "1MiB");
  EXPECT_EQ(human_bytes(64u << 10), "64KiB");
  EXPECT_EQ(human_bytes(300), "300B");
}

TEST(Netlab, RatesInTcUnits) {
  EXPECT_EQ(*parse_link_rate("1gbit"), 1000000000u);
  EXPECT_EQ(*parse_link_rate("2.5gbit"), 2500000000u);
  EXPECT_EQ(*parse_link_rate("500mbit"), 500000000u);
  EXPECT_EQ(*parse_link_rate("64kbit"), 64000u);
  for (const char* bad : {"", "1", "gbit", "1gbps", "1 gbit", "1kbit"}) {
    auto r = parse_link_rate(bad);
    EXPECT_FALSE(r) << bad;
    if (!r) {
      EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
    }
  }
}

}  // namespace
}  // namespace tally::bench
