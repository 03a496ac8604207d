// The x86 tables (kernels_x86.cc), private to the kernels library.
#pragma once

#include "tally/protocol/kernels.h"

namespace tally::kernels_detail {

const KernelTable& scalar_table();
// Null where the build is not x86-64 or the CPU lacks the level.
const KernelTable* avx2_table();
const KernelTable* avx512_table();

}  // namespace tally::kernels_detail
