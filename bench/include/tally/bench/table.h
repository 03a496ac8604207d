// The bench's table rows, nccl-tests style: one format written by
// tally-bench's worker and by the peers (tally-peer-gloo, tally-peer-mpi),
// and one parser the driver reads every table back with (--compare).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace tally::bench {

struct TableRow {
  size_t bytes = 0;
  size_t count = 0;
  std::string type;   // "float", ...
  std::string redop;  // "sum", ...
  double time_us = 0;
  double algbw = 0;  // GB/s: bytes / time
  double busbw = 0;  // GB/s: algbw x the algorithm's bus factor
  double wrong = 0;
};

// The column header line ("#       size ...").
std::string table_header();

// One row line, with its newline.
std::string format_row(const TableRow& row);

// Every row line in `text` (other lines, "#" comments included, are
// skipped), in order.
std::vector<TableRow> parse_rows(const std::string& text);

// A table with its name: the "# table NAME ..." line that opens it (the
// peers print one per algorithm).
struct NamedTable {
  std::string name;
  std::vector<TableRow> rows;
};

// The tables in `text`: each "# table NAME" line opens one; rows before any
// such line go to a table named `first`.
std::vector<NamedTable> parse_tables(const std::string& text, const std::string& first);

// Copies what a child writes to a file onto this process's stdout as it
// comes (the driver shows rank 0's table live while keeping it to parse).
class FileEcho {
 public:
  explicit FileEcho(std::string path) : path_(std::move(path)) {}
  // Writes the bytes added since the last call; returns all read so far.
  const std::string& poll();
  const std::string& text() const { return text_; }

 private:
  std::string path_;
  std::string text_;
};

// "4KiB", "1MiB", "300B".
std::string human_bytes(size_t bytes);

}  // namespace tally::bench
