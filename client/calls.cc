// The calls that start ops, on the caller's thread: arguments checked, ops
// numbered, fused and posted to the client's io_context; the blocking calls
// then run that context themselves where they can (io_driver.h).
#include <boost/asio/post.hpp>
#include <cstring>
#include <limits>
#include <mutex>

#include "client_impl.h"
#include "op_state.h"
#include "tally/client/client.h"
#include "tally/protocol/chunking.h"

namespace tally {
namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;
using client_internal::backstop;
using client_internal::kDrainGrace;
using std::chrono::milliseconds;

Result<std::shared_ptr<Op>> Client::Impl::make_op(void* data, size_t count, DType dtype,
                                                  RedOp redop) {
  const size_t esize = dtype_size(dtype);
  if (esize == 0) return Status(ErrorCode::kInvalidArgument, "unknown dtype");
  if (redop != RedOp::kSum && redop != RedOp::kAverage) {
    return Status(ErrorCode::kInvalidArgument, "unknown reduction");
  }
  if (count > std::numeric_limits<uint64_t>::max() / esize) {
    return Status(ErrorCode::kInvalidArgument, "element count overflows");
  }
  if (count == 0)
    return std::shared_ptr<Op>();  // nothing to sum; the op number is used all the same
  if (data == nullptr) return Status(ErrorCode::kInvalidArgument, "null buffer");
  if (reinterpret_cast<uintptr_t>(data) % esize != 0) {
    return Status(ErrorCode::kInvalidArgument, "buffer is not aligned to its element size");
  }
  auto op = std::make_shared<Op>();
  op->called = Clock::now();
  op->data = static_cast<std::byte*>(data);
  op->count = count;
  op->dtype = dtype;
  op->redop = redop;
  // The bfloat16 wire applies to float32 tensors only; others travel as they are.
  op->wire = dtype == DType::kFloat32 && options.wire_dtype ? *options.wire_dtype : dtype;
  op->wide_result = op->wire != dtype && options.wire_result == DType::kFloat32;
  const DType wire = op->wire;
  const size_t wsize = dtype_size(wire);
  op->plan.emplace(count * wsize, wire, static_cast<uint32_t>(links.size()), plan_settings);
  if (options.chunk_bytes > 0 &&
      options.chunk_bytes / wsize > max_chunk_elements(plan_settings.max_chunk_bytes, wire)) {
    return Status(ErrorCode::kInvalidArgument,
                  "chunk size " + std::to_string(options.chunk_bytes) +
                      " (TALLY_CHUNK_BYTES) holds " + std::to_string(options.chunk_bytes / wsize) +
                      " " + std::string(dtype_name(wire)) + " elements; the reducers sum at most " +
                      std::to_string(max_chunk_elements(plan_settings.max_chunk_bytes, wire)) +
                      " per chunk (16-bit types accumulate in float32): lower TALLY_CHUNK_BYTES");
  }
  if (op->plan->chunk_count() > std::numeric_limits<uint32_t>::max()) {
    return Status(ErrorCode::kInvalidArgument,
                  "tensor has more than 2^32 chunks; raise the chunk size");
  }
  return op;
}

OpHandle Client::Impl::submit(const std::vector<std::shared_ptr<Op>>& batch,
                              std::shared_ptr<OpHandle::State> handle, OpCallback on_done,
                              Runner runner) {
  // The I/O thread ends every op by its backstop plus the drain grace.
  handle->wait_limit = backstop(options.op_timeout) + kDrainGrace + milliseconds(30000);
  handle->callback = std::move(on_done);
  size_t live = 0;
  for (auto& op : batch) live += op != nullptr;
  handle->pending = live + 1;  // + 1: this call's own share, ended below
  {
    // Ids are taken and ops posted under one lock, so the I/O thread starts
    // ops in id order even when several threads call allreduce.
    std::lock_guard order(start_mu);
    if (!batch.empty()) handle->first_op = next_op.load();
    for (auto& op : batch) {
      const uint64_t id = next_op.fetch_add(1);
      if (!op) continue;
      op->id = id;
      // The plan's first shard follows the op's number (chunking.h).
      op->plan.emplace(op->plan->nbytes(), op->wire, op->plan->shards(), plan_settings, id);
      op->handle = handle;
      asio::post(io, [this, op] { start_op(op); });
    }
  }
  if (runner == Runner::kIoThread) driver.kick();
  handle->end_one(Status::ok());  // the callback cannot run before first_op is set
  return OpHandle(std::move(handle));
}

OpHandle Client::allreduce_async(void* data, size_t count, DType dtype, RedOp redop,
                                 OpCallback on_done) {
  auto op = impl_->make_op(data, count, dtype, redop);
  if (!op) return OpHandle::State::ended(op.status(), std::move(on_done));
  return impl_->submit({*op}, std::make_shared<OpHandle::State>(), std::move(on_done));
}

Result<Client::Impl::Fused> Client::Impl::fuse(std::span<const BufferRef> buffers, DType dtype,
                                               RedOp redop, size_t fuse_bytes) {
  const size_t esize = dtype_size(dtype);
  // Every buffer is checked before any op number is taken.
  for (const BufferRef& b : buffers) {
    if (auto op = make_op(b.data, b.count, dtype, redop); !op) return op.status();
  }
  Fused fused{{}, std::make_shared<OpHandle::State>()};
  std::vector<const BufferRef*> group;
  size_t group_bytes = 0;
  Status bad;
  auto flush = [&] {
    if (group.size() == 1) {
      fused.batch.push_back(*make_op(group[0]->data, group[0]->count, dtype, redop));
    } else if (group.size() > 1) {
      OpHandle::State::Staged staged;
      staged.bytes.resize(group_bytes);
      size_t offset = 0;
      for (const BufferRef* b : group) {
        const size_t nbytes = b->count * esize;
        std::memcpy(staged.bytes.data() + offset, b->data, nbytes);
        staged.parts.emplace_back(static_cast<std::byte*>(b->data), nbytes);
        offset += nbytes;
      }
      auto op = make_op(staged.bytes.data(), group_bytes / esize, dtype, redop);
      if (!op) {
        bad = op.status();  // a fused group with more than 2^32 chunks
      } else {
        fused.batch.push_back(*op);
        fused.handle->staged.push_back(std::move(staged));
      }
    }
    group.clear();
    group_bytes = 0;
  };
  for (const BufferRef& b : buffers) {
    if (b.count == 0) continue;
    const size_t nbytes = b.count * esize;
    if (nbytes >= fuse_bytes) {
      flush();
      group.push_back(&b);
      group_bytes = nbytes;
      flush();
      continue;
    }
    if (group_bytes + nbytes > fuse_bytes) flush();
    group.push_back(&b);
    group_bytes += nbytes;
  }
  flush();
  if (!bad.is_ok()) return bad;
  return fused;
}

OpHandle Client::allreduce_fused_async(std::span<const BufferRef> buffers, DType dtype, RedOp redop,
                                       size_t fuse_bytes, OpCallback on_done) {
  auto fused = impl_->fuse(buffers, dtype, redop, fuse_bytes);
  if (!fused) return OpHandle::State::ended(fused.status(), std::move(on_done));
  return impl_->submit(fused->batch, std::move(fused->handle), std::move(on_done));
}

Status Client::allreduce_fused(std::span<const BufferRef> buffers, DType dtype, RedOp redop,
                               size_t fuse_bytes) {
  auto fused = impl_->fuse(buffers, dtype, redop, fuse_bytes);
  if (!fused) return fused.status();
  return impl_->blocking(fused->batch, std::move(fused->handle));
}

Status Client::Impl::blocking(const std::vector<std::shared_ptr<Op>>& batch,
                              std::shared_ptr<OpHandle::State> handle) {
  if (!driver.borrow()) return submit(batch, std::move(handle), {}).wait();
  const OpHandle op = submit(batch, handle, {}, Runner::kCaller);
  driver.run_until([&] { return op.test().has_value(); }, Clock::now() + handle->wait_limit);
  // Ops of other callers still in flight go back to the I/O thread.
  driver.give_back(ops.empty());
  return op.wait();
}

Status Client::allreduce(void* data, size_t count, DType dtype, RedOp redop) {
  auto op = impl_->make_op(data, count, dtype, redop);
  if (!op) return op.status();
  return impl_->blocking({*op}, std::make_shared<OpHandle::State>());
}

}  // namespace tally
