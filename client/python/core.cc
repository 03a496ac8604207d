// tally._core: the Python binding of libtally (pybind11, no torch headers).
//
// Buffers: a torch.Tensor is read through its own attributes (device,
// layout, contiguity, dtype, data_ptr, numel), anything else through the
// buffer protocol (numpy arrays, array.array, bytearray views). Either way
// the op writes in place, with no copy, and the op itself keeps the object
// (and its buffer export) alive until it has ended, whatever happens to the
// handle.
//
// Threads and the GIL: every wait releases the GIL. Callbacks never run on
// libtally's I/O thread: it only queues the ended op for this client's
// completer thread, which takes the GIL, runs the Python callback and drops
// the op's references. So a busy interpreter never stalls the I/O thread.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tally/client/client.h"
#include "tally/client/option_names.h"
#include "tally/protocol/version.h"

namespace py = pybind11;

namespace tally::python {
namespace {

using std::chrono::milliseconds;

// How often a blocked wait wakes to let Ctrl-C (KeyboardInterrupt) through.
constexpr milliseconds kSignalPoll{100};

// The tally.Error subclass for `s`, instantiated with the core's message.
py::object make_error(const Status& s) {
  py::object errors = py::module_::import("tally.errors");
  return errors.attr("error_for")(static_cast<int>(s.code()), s.message());
}

[[noreturn]] void raise(const Status& s) {
  py::object e = make_error(s);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(e.ptr())), e.ptr());
  throw py::error_already_set();
}

[[noreturn]] void raise_invalid(const std::string& message) {
  raise(Status(ErrorCode::kInvalidArgument, message));
}

// Drops a reference only while holding the GIL (members of objects that the
// I/O or completer thread may destroy).
void drop(py::object& o) {
  if (o) o.release().dec_ref();
}

// A buffer an op writes into, and what keeps it valid.
struct Target {
  void* data = nullptr;
  size_t count = 0;
  DType dtype = DType::kFloat32;
  py::object owner;
  std::unique_ptr<Py_buffer> view;  // set when exported through the buffer protocol

  Target() = default;
  Target(Target&&) = default;
  Target& operator=(Target&&) = default;
  // The GIL must be held.
  void release() {
    if (view) {
      PyBuffer_Release(view.get());
      view.reset();
    }
    drop(owner);
  }
  ~Target() {
    if (owner || view) {
      py::gil_scoped_acquire gil;
      release();
    }
  }
};

std::string type_name(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__name__")); }

bool is_torch_tensor(py::handle obj) {
  py::handle type = py::type::handle_of(obj);
  if (!py::hasattr(obj, "data_ptr") || !py::hasattr(obj, "is_contiguous")) return false;
  const std::string module = py::str(type.attr("__module__"));
  return module.rfind("torch", 0) == 0;
}

Target from_tensor(py::handle t) {
  Target target;
  const std::string device = py::str(t.attr("device"));
  if (py::str(t.attr("device").attr("type")).cast<std::string>() != "cpu") {
    raise_invalid("tensor is on device '" + device +
                  "': tally reduces host memory; copy it with .cpu() and back (the DDP hook "
                  "needs a CPU model)");
  }
  if (py::str(t.attr("layout")).cast<std::string>() != "torch.strided") {
    raise_invalid("tensor has layout " + py::str(t.attr("layout")).cast<std::string>() +
                  ": tally reduces dense tensors only");
  }
  if (!t.attr("is_contiguous")().cast<bool>()) {
    raise_invalid(
        "tensor is not contiguous: reduce t.contiguous() and copy the result back (tally writes "
        "the result in place into one block of memory)");
  }
  if (t.attr("requires_grad").cast<bool>()) {
    raise_invalid(
        "tensor requires grad: reduce t.detach() or t.grad (an in-place write behind autograd's "
        "back would corrupt its graph)");
  }
  static const std::map<std::string, DType> dtypes{
      {"torch.float32", DType::kFloat32}, {"torch.float64", DType::kFloat64},
      {"torch.float16", DType::kFloat16}, {"torch.bfloat16", DType::kBFloat16},
      {"torch.int32", DType::kInt32},     {"torch.int64", DType::kInt64}};
  const std::string dtype = py::str(t.attr("dtype"));
  auto it = dtypes.find(dtype);
  if (it == dtypes.end()) {
    raise_invalid("tensor dtype " + dtype +
                  " is not supported (float32, float64, float16, bfloat16, int32, int64)");
  }
  target.dtype = it->second;
  target.count = t.attr("numel")().cast<size_t>();
  target.data = reinterpret_cast<void*>(t.attr("data_ptr")().cast<uintptr_t>());
  target.owner = py::reinterpret_borrow<py::object>(t);
  return target;
}

Target from_buffer(py::handle obj) {
  Target target;
  if (!PyObject_CheckBuffer(obj.ptr())) {
    raise_invalid(
        "expected a torch.Tensor or an object with the buffer protocol (numpy array), got " +
        type_name(obj));
  }
  auto view = std::make_unique<Py_buffer>();
  if (PyObject_GetBuffer(obj.ptr(), view.get(), PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_STRIDES) !=
      0) {
    PyErr_Clear();
    raise_invalid(type_name(obj) +
                  " is read-only: tally writes the result in place (pass a writable copy, e.g. "
                  "numpy.array(x))");
  }
  target.owner = py::reinterpret_borrow<py::object>(obj);
  target.view = std::move(view);  // released by Target from here on
  Py_buffer& v = *target.view;
  if (!PyBuffer_IsContiguous(&v, 'A')) {
    raise_invalid(type_name(obj) +
                  " is not contiguous: reduce a contiguous copy (numpy.ascontiguousarray) and copy "
                  "the result back");
  }
  std::string format = v.format ? v.format : "B";
  char order = '@';
  if (!format.empty() && std::string("@=<>!").find(format[0]) != std::string::npos) {
    order = format[0];
    format.erase(0, 1);
  }
  if (order == '>' || order == '!') raise_invalid("big-endian buffers are not supported");
  const size_t item = static_cast<size_t>(v.itemsize);
  if (format == "f" && item == 4) {
    target.dtype = DType::kFloat32;
  } else if (format == "d" && item == 8) {
    target.dtype = DType::kFloat64;
  } else if ((format == "i" || format == "l" || format == "q") && item == 4) {
    target.dtype = DType::kInt32;
  } else if ((format == "i" || format == "l" || format == "q") && item == 8) {
    target.dtype = DType::kInt64;
  } else if (format == "e" && item == 2) {
    target.dtype = DType::kFloat16;
  } else {
    raise_invalid("buffer format '" + std::string(v.format ? v.format : "B") +
                  "' is not supported (float32, float64, float16, int32, int64)");
  }
  target.data = v.buf;
  target.count = static_cast<size_t>(v.len) / item;
  return target;
}

Target resolve(py::handle obj) {
  return is_torch_tensor(obj) ? from_tensor(obj) : from_buffer(obj);
}

RedOp parse_op(const std::string& op) {
  if (op == "sum") return RedOp::kSum;
  if (op == "avg" || op == "average" || op == "mean") return RedOp::kAverage;
  raise_invalid("op must be 'sum' or 'avg', not '" + op + "'");
}

// One Python-level op: its buffers, what wait() returns, the callback.
struct PyOp {
  std::vector<Target> targets;
  py::object result;
  py::object callback;
  OpHandle handle;

  ~PyOp() {
    if (!result && !callback) return;
    py::gil_scoped_acquire gil;
    drop(result);
    drop(callback);
  }
};

// Runs Python callbacks of ended ops, and drops their references, on its own
// thread under the GIL.
class Completer {
 public:
  Completer() : thread_([this] { run(); }) {}
  ~Completer() { stop(); }

  // Any thread, no GIL needed.
  void push(std::shared_ptr<PyOp> op, Status status) {
    {
      std::lock_guard lock(mu_);
      queue_.emplace_back(std::move(op), std::move(status));
    }
    cv_.notify_one();
  }

  // Runs what is queued, then ends the thread. The caller must not hold the GIL.
  void stop() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    std::unique_lock lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      auto [op, status] = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      if (Py_IsInitialized()) {
        py::gil_scoped_acquire gil;
        if (op->callback) {
          try {
            op->callback(status.is_ok() ? py::none() : make_error(status));
          } catch (py::error_already_set& e) {
            e.discard_as_unraisable("tally callback");
          }
        }
        op.reset();  // the last reference, under the GIL
      }
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::shared_ptr<PyOp>, Status>> queue_;
  bool stopping_ = false;
  std::thread thread_;  // last: started once the members above exist
};

// Waits for `handle` with the GIL released, waking to let signals through.
// Returns the op's Status, or nullopt if `timeout` (when given) passed first.
std::optional<Status> wait_releasing_gil(const OpHandle& handle, std::optional<double> timeout) {
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    auto step = kSignalPoll;
    if (timeout) {
      auto left = std::chrono::duration_cast<milliseconds>(
          std::chrono::duration<double>(*timeout) - (std::chrono::steady_clock::now() - start));
      if (left <= milliseconds(0)) return handle.test();
      step = std::min(step, left);
    }
    std::optional<Status> s;
    {
      py::gil_scoped_release nogil;
      s = handle.wait_for(step);
    }
    if (s) return s;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

class Handle {
 public:
  explicit Handle(std::shared_ptr<PyOp> op) : op_(std::move(op)) {}

  // The buffer(s) once the op has succeeded; raises its error otherwise.
  py::object wait(std::optional<double> timeout) {
    auto s = wait_releasing_gil(op_->handle, timeout);
    if (!s) {
      PyErr_SetString(PyExc_TimeoutError,
                      ("tally op " + std::to_string(op_->handle.op().value_or(0)) +
                       " still in flight after the wait's timeout")
                          .c_str());
      throw py::error_already_set();
    }
    if (!s->is_ok()) raise(*s);
    return op_->result;
  }
  bool done() const { return op_->handle.test().has_value(); }
  std::optional<uint64_t> op() const { return op_->handle.op(); }

 private:
  std::shared_ptr<PyOp> op_;
};

class PyClient {
 public:
  explicit PyClient(const std::map<std::string, std::string>& settings) {
    ClientOptions options;
    for (const std::string_view name : client_option_names()) {  // in the environment's order
      auto it = settings.find(std::string(name));
      if (it == settings.end()) continue;
      if (Status s = set_client_option(options, it->first, it->second); !s.is_ok()) raise(s);
    }
    for (auto& [name, value] : settings) {
      ClientOptions scratch;  // rejects unknown names and malformed values alike
      if (Status s = set_client_option(scratch, name, value); !s.is_ok()) raise(s);
    }
    Result<std::unique_ptr<Client>> client = Status(ErrorCode::kInternal, "not connected");
    {
      py::gil_scoped_release nogil;
      client = Client::connect(options);
    }
    if (!client) raise(client.status());
    client_ = std::move(*client);
    completer_ = std::make_shared<Completer>();
  }

  ~PyClient() {
    if (PyGILState_Check()) {
      py::gil_scoped_release nogil;
      shut();
    } else {
      shut();
    }
  }

  void close() {
    py::gil_scoped_release nogil;
    shut();
  }

  Client& client() {
    if (!client_) raise(Status(ErrorCode::kCancelled, "the client is closed"));
    return *client_;
  }

  Handle start(py::object obj, const std::string& op, py::object callback) {
    const RedOp redop = parse_op(op);
    auto py_op = std::make_shared<PyOp>();
    py_op->targets.push_back(resolve(obj));
    py_op->result = obj;
    if (!callback.is_none()) py_op->callback = callback;
    const Target& t = py_op->targets[0];
    py_op->handle = client().allreduce_async(t.data, t.count, t.dtype, redop, on_done(py_op));
    return Handle(py_op);
  }

  Handle start_fused(py::list objs, const std::string& op, size_t fuse_bytes, py::object callback) {
    const RedOp redop = parse_op(op);
    auto py_op = std::make_shared<PyOp>();
    std::vector<BufferRef> buffers;
    for (py::handle obj : objs) {
      py_op->targets.push_back(resolve(obj));
      const Target& t = py_op->targets.back();
      if (t.dtype != py_op->targets[0].dtype) {
        raise_invalid("fused buffers must share one dtype: item " + std::to_string(buffers.size()) +
                      " is " + std::string(dtype_name(t.dtype)) + ", item 0 is " +
                      std::string(dtype_name(py_op->targets[0].dtype)));
      }
      buffers.push_back({t.data, t.count});
    }
    py_op->result = objs;
    if (!callback.is_none()) py_op->callback = callback;
    const DType dtype = buffers.empty() ? DType::kFloat32 : py_op->targets[0].dtype;
    py_op->handle =
        client().allreduce_fused_async(buffers, dtype, redop, fuse_bytes, on_done(py_op));
    return Handle(py_op);
  }

 private:
  // The core's callback: hands the op to the completer (moving the
  // reference out, so the I/O thread never drops the last one).
  OpCallback on_done(const std::shared_ptr<PyOp>& py_op) {
    return [completer = completer_, op = py_op](const Status& s) mutable {
      completer->push(std::move(op), s);
    };
  }

  // Without the GIL: ends in-flight ops (kCancelled), then runs their callbacks.
  void shut() {
    client_.reset();
    if (completer_) completer_->stop();
  }

  std::unique_ptr<Client> client_;
  std::shared_ptr<Completer> completer_;
};

}  // namespace
}  // namespace tally::python

PYBIND11_MODULE(_core, m) {
  using namespace tally;
  using namespace tally::python;
  m.doc() = "libtally's Python binding; use the `tally` package.";
  m.def("version", [] { return version_string(); });
  m.def("option_names", [] {
    std::vector<std::string> names;
    for (auto n : client_option_names()) names.emplace_back(n);
    return names;
  });
  m.attr("DEFAULT_FUSE_BYTES") = kDefaultFuseBytes;

  py::class_<Handle>(m, "Handle", "An all-reduce in flight (tally.Client.allreduce_async).")
      .def("wait", &Handle::wait, py::arg("timeout") = py::none(),
           "Blocks (GIL released) until the op ends; returns the reduced buffer(s) or raises its "
           "tally.Error. With `timeout` (seconds), raises the builtin TimeoutError if still in "
           "flight then.")
      .def("done", &Handle::done, "True once the op has ended (never blocks).")
      .def_property_readonly("op", &Handle::op,
                             "The op's collective number (None if it took none).");

  py::class_<PyClient>(m, "Client")
      .def(py::init<const std::map<std::string, std::string>&>(), py::arg("settings"))
      .def("allreduce_async", &PyClient::start, py::arg("buffer"), py::arg("op") = "sum",
           py::arg("callback") = py::none())
      .def("allreduce_fused_async", &PyClient::start_fused, py::arg("buffers"),
           py::arg("op") = "sum", py::arg("fuse_bytes") = kDefaultFuseBytes,
           py::arg("callback") = py::none())
      .def("close", &PyClient::close)
      .def_property_readonly("rank", [](PyClient& c) { return c.client().rank(); })
      .def_property_readonly("world_size", [](PyClient& c) { return c.client().world_size(); })
      .def_property_readonly("shards", [](PyClient& c) { return c.client().shards(); })
      .def_property_readonly("groups", [](PyClient& c) { return c.client().groups(); })
      .def_property_readonly("group", [](PyClient& c) { return c.client().group(); });
}
