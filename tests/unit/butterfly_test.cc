// The butterfly schedule, run as a message-passing simulation: for every
// participant count 1..8, several element counts (including chunks too
// small to split) and every participant, all replicas must end with every
// partial summed exactly once, in the same combination tree (so the same
// bits), every frame sent must be received by a step expecting exactly
// that range, and the traffic must match the formula.
#include "tally/reducer/butterfly.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <string>
#include <vector>

namespace tally {
namespace {

// A value is a combination tree of partials written canonically: since
// IEEE addition is commutative, a+b and b+a are the same tree.
std::string combine(const std::string& a, const std::string& b) {
  return a < b ? "(" + a + "+" + b + ")" : "(" + b + "+" + a + ")";
}

struct Message {
  uint32_t tag;
  ElementRange range;
  std::vector<std::string> values;
};

struct Outcome {
  std::vector<std::vector<std::string>> values;  // by participant, element
  std::vector<uint64_t> sent;                    // elements, by participant
  std::vector<uint64_t> received;
};

Outcome simulate(uint32_t n, uint64_t elements) {
  std::vector<std::vector<ButterflyStep>> schedules;
  Outcome out;
  for (uint32_t i = 0; i < n; ++i) {
    schedules.push_back(butterfly_schedule(n, i, elements));
    out.values.emplace_back(elements, "p" + std::to_string(i));
  }
  out.sent.assign(n, 0);
  out.received.assign(n, 0);
  std::map<std::pair<uint32_t, uint32_t>, std::deque<Message>> wires;  // (from, to)
  std::vector<size_t> pc(n, 0);
  std::vector<bool> sent_current(n, false);
  bool progress = true;
  while (progress) {
    progress = false;
    for (uint32_t i = 0; i < n; ++i) {
      if (pc[i] == schedules[i].size()) continue;
      const ButterflyStep& s = schedules[i][pc[i]];
      EXPECT_LT(s.partner, n);
      EXPECT_NE(s.partner, i);
      if (!sent_current[i]) {
        sent_current[i] = true;
        if (!s.send.empty()) {
          Message m{s.tag, s.send, {}};
          for (uint64_t e = s.send.begin; e < s.send.end; ++e) m.values.push_back(out.values[i][e]);
          wires[{i, s.partner}].push_back(std::move(m));
          out.sent[i] += s.send.size();
        }
        progress = true;
      }
      if (!s.recv.empty()) {
        auto& wire = wires[{s.partner, i}];
        auto it = std::find_if(wire.begin(), wire.end(),
                               [&](const Message& m) { return m.tag == s.tag; });
        if (it == wire.end()) continue;
        EXPECT_EQ(it->range, s.recv)
            << "n=" << n << " E=" << elements << " participant " << i << " tag " << s.tag;
        for (uint64_t e = s.recv.begin; e < s.recv.end; ++e) {
          const std::string& v = it->values[e - s.recv.begin];
          out.values[i][e] =
              s.apply == ButterflyStep::Apply::kAdd ? combine(out.values[i][e], v) : v;
        }
        EXPECT_NE(s.apply, ButterflyStep::Apply::kNone);
        out.received[i] += s.recv.size();
        wire.erase(it);
      }
      pc[i]++;
      sent_current[i] = false;
      progress = true;
    }
  }
  for (uint32_t i = 0; i < n; ++i)
    EXPECT_EQ(pc[i], schedules[i].size()) << "participant " << i << " stuck";
  for (auto& [key, wire] : wires)
    EXPECT_TRUE(wire.empty()) << "unreceived frame " << key.first << "->" << key.second;
  return out;
}

// Each partial p0..p(n-1) occurs exactly once in `tree`.
bool sums_each_once(const std::string& tree, uint32_t n) {
  for (uint32_t j = 0; j < n; ++j) {
    const std::string token = "p" + std::to_string(j);
    size_t count = 0;
    for (size_t at = tree.find(token); at != std::string::npos; at = tree.find(token, at + 1)) {
      const size_t after = at + token.size();
      if (after == tree.size() || !std::isdigit(static_cast<unsigned char>(tree[after]))) ++count;
    }
    if (count != 1) return false;
  }
  return true;
}

TEST(Butterfly, EveryReplicaEndsWithTheSameFullSum) {
  for (uint32_t n = 1; n <= 8; ++n) {
    for (uint64_t elements :
         {1ull, 2ull, 3ull, 4ull, 5ull, 7ull, 8ull, 9ull, 31ull, 100ull, 1009ull}) {
      SCOPED_TRACE("n=" + std::to_string(n) + " E=" + std::to_string(elements));
      Outcome out = simulate(n, elements);
      for (uint64_t e = 0; e < elements; ++e) {
        ASSERT_TRUE(sums_each_once(out.values[0][e], n)) << out.values[0][e];
        for (uint32_t i = 1; i < n; ++i)
          ASSERT_EQ(out.values[i][e], out.values[0][e]) << "element " << e;
      }
    }
  }
}

TEST(Butterfly, PowerOfTwoTrafficIsTwiceNMinusOneOverN) {
  for (uint32_t n : {2u, 4u, 8u}) {
    const uint64_t elements = 64 * n;
    Outcome out = simulate(n, elements);
    for (uint32_t i = 0; i < n; ++i) {
      EXPECT_EQ(out.sent[i], 2 * (n - 1) * elements / n) << "n=" << n;
      EXPECT_EQ(out.received[i], 2 * (n - 1) * elements / n) << "n=" << n;
    }
  }
}

TEST(Butterfly, ExtrasFoldInAndOut) {
  // n = 3: P = 2; participant 2 folds into 0.
  const uint64_t elements = 100;
  Outcome out = simulate(3, elements);
  EXPECT_EQ(out.sent[2], elements);
  EXPECT_EQ(out.received[2], elements);
  EXPECT_EQ(out.sent[0], elements + elements);  // half + half + fold-out
  EXPECT_EQ(out.received[0], elements + elements);
  EXPECT_EQ(out.sent[1], elements);
  auto s2 = butterfly_schedule(3, 2, elements);
  ASSERT_EQ(s2.size(), 2u);
  EXPECT_EQ(s2[0].partner, 0u);
  EXPECT_EQ(s2[0].tag, kTagFoldIn);
  EXPECT_EQ(s2[1].tag, kTagFoldOut);
  EXPECT_EQ(s2[1].apply, ButterflyStep::Apply::kCopy);
}

TEST(Butterfly, TinyChunksUseRecursiveDoubling) {
  // 3 elements over a core of 4: no split, two doubling steps of the whole chunk.
  auto steps = butterfly_schedule(4, 1, 3);
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].partner, 0u);
  EXPECT_EQ(steps[1].partner, 3u);
  for (auto& s : steps) {
    EXPECT_EQ(s.send, (ElementRange{0, 3}));
    EXPECT_EQ(s.recv, (ElementRange{0, 3}));
    EXPECT_EQ(s.apply, ButterflyStep::Apply::kAdd);
  }
}

TEST(Butterfly, RabenseifnerSegmentsFollowTheIndex) {
  // n = 4, E = 8: participant i owns elements [2i, 2i+2) after the reduce-scatter.
  for (uint32_t i = 0; i < 4; ++i) {
    auto steps = butterfly_schedule(4, i, 8);
    ASSERT_EQ(steps.size(), 4u);
    EXPECT_EQ(steps[1].recv, (ElementRange{2 * i, 2 * i + 2}));
    EXPECT_EQ(steps[2].send, (ElementRange{2 * i, 2 * i + 2}));
  }
}

TEST(Butterfly, MaxReceives) {
  EXPECT_EQ(butterfly_max_receives(1), 0u);
  EXPECT_EQ(butterfly_max_receives(2), 2u);
  EXPECT_EQ(butterfly_max_receives(3), 3u);
  EXPECT_EQ(butterfly_max_receives(4), 4u);
  EXPECT_EQ(butterfly_max_receives(5), 5u);
  EXPECT_EQ(butterfly_max_receives(8), 6u);
  for (uint32_t n = 1; n <= 8; ++n) {
    for (uint32_t i = 0; i < n; ++i) {
      for (uint64_t e : {1ull, 3ull, 100ull}) {
        uint32_t receives = 0;
        for (auto& s : butterfly_schedule(n, i, e)) receives += !s.recv.empty();
        EXPECT_LE(receives, butterfly_max_receives(n));
      }
    }
  }
}

TEST(Butterfly, TrafficClosedForm) {
  EXPECT_EQ(butterfly_traffic(1, 0, 100), 0.0);
  EXPECT_EQ(butterfly_traffic(2, 0, 100), 1.0);  // 2(2-1)/2
  EXPECT_EQ(butterfly_traffic(4, 3, 100), 1.5);  // 2(4-1)/4
  EXPECT_EQ(butterfly_traffic(8, 5, 100), 1.75);
  EXPECT_EQ(butterfly_traffic(3, 0, 100), 2.0);  // core paired with extra 2
  EXPECT_EQ(butterfly_traffic(3, 1, 100), 1.0);  // core, unpaired
  EXPECT_EQ(butterfly_traffic(3, 2, 100), 1.0);  // the extra
  EXPECT_EQ(butterfly_traffic(5, 4, 1), 1.0);
  EXPECT_EQ(butterfly_traffic(4, 1, 3), 2.0);  // E < P: log2(4) doubling steps
  EXPECT_EQ(butterfly_traffic(5, 0, 3), 3.0);  // doubling plus the fold
}

TEST(Butterfly, TrafficMatchesTheScheduleWhenPDividesTheChunk) {
  for (uint32_t n = 1; n <= 8; ++n) {
    for (uint64_t elements : {1ull, 2ull, 3ull, 8ull, 64ull, 1024ull}) {
      uint32_t p = 1;
      while (p * 2 <= n) p *= 2;
      if (elements >= p && elements % p != 0) continue;
      SCOPED_TRACE("n=" + std::to_string(n) + " E=" + std::to_string(elements));
      Outcome out = simulate(n, elements);
      for (uint32_t i = 0; i < n; ++i) {
        const double expected = butterfly_traffic(n, i, elements) * static_cast<double>(elements);
        EXPECT_EQ(static_cast<double>(out.sent[i]), expected) << "participant " << i;
        EXPECT_EQ(static_cast<double>(out.received[i]), expected) << "participant " << i;
      }
    }
  }
}

}  // namespace
}  // namespace tally
