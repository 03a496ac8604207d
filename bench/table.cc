#include "tally/bench/table.h"

#include <cctype>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace tally::bench {

std::string table_header() {
  char line[160];
  std::snprintf(line, sizeof(line), "# %10s %12s %8s %6s %10s %12s %12s %8s\n", "size", "count",
                "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong");
  return line;
}

std::string format_row(const TableRow& row) {
  char line[200];
  std::snprintf(line, sizeof(line), "  %10zu %12zu %8s %6s %10.1f %12.3f %12.3f %8.0f\n", row.bytes,
                row.count, row.type.c_str(), row.redop.c_str(), row.time_us, row.algbw, row.busbw,
                row.wrong);
  return line;
}

std::vector<TableRow> parse_rows(const std::string& text) {
  std::vector<TableRow> rows;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    // A row starts with two spaces and a digit; comment lines with '#'.
    if (line.size() < 3 || line[0] != ' ' || line.find('#') != std::string::npos) continue;
    std::istringstream fields(line);
    TableRow r;
    if (fields >> r.bytes >> r.count >> r.type >> r.redop >> r.time_us >> r.algbw >> r.busbw >>
            r.wrong &&
        !r.type.empty() && std::isalpha(static_cast<unsigned char>(r.type[0]))) {
      rows.push_back(r);  // (the byte report's rows have a number there)
    }
  }
  return rows;
}

std::vector<NamedTable> parse_tables(const std::string& text, const std::string& first) {
  std::vector<NamedTable> tables;
  std::istringstream lines(text);
  std::string line, section;
  std::string current = first;
  auto flush = [&] {
    auto rows = parse_rows(section);
    if (!rows.empty()) tables.push_back({current, std::move(rows)});
    section.clear();
  };
  while (std::getline(lines, line)) {
    if (line.rfind("# table ", 0) == 0) {
      flush();
      const std::string rest = line.substr(8);
      current = rest.substr(0, rest.find(' '));
      continue;
    }
    section += line + "\n";
  }
  flush();
  return tables;
}

const std::string& FileEcho::poll() {
  std::ifstream in(path_, std::ios::binary);
  if (!in) return text_;
  in.seekg(static_cast<std::streamoff>(text_.size()));
  std::string added((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Whole lines only, so a row is never split between two polls.
  const auto end = added.rfind('\n');
  if (end == std::string::npos) return text_;
  added.resize(end + 1);
  std::fwrite(added.data(), 1, added.size(), stdout);
  std::fflush(stdout);
  text_ += added;
  return text_;
}

std::string human_bytes(size_t b) {
  if (b >= (1u << 20) && b % (1u << 20) == 0) return std::to_string(b >> 20) + "MiB";
  if (b >= 1024 && b % 1024 == 0) return std::to_string(b >> 10) + "KiB";
  return std::to_string(b) + "B";
}

}  // namespace tally::bench
